"""One answer assembled from the engine's stream (translate/assemble.py), fed bytes: the
text and finish of each choice, tool calls with their arguments joined, both kinds of
logprobs, the engine's usage as it said it (else the hub's count), an engine that answered
whole anyway taken as it is, and the end at a stop sequence."""

from __future__ import annotations

import json
from typing import Any

from appliance.hub.translate.assemble import Assembler, streamed


def _sse(*objs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + \
        b"data: [DONE]\n\n"


def _chunk(choice: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [{"index": 0, "finish_reason": None, **choice}], **top}


def test_text_tool_calls_and_usage_are_gathered() -> None:
    a = Assembler(10, chat=True)
    data = _sse(_chunk({"delta": {"role": "assistant", "content": ""}}),
                _chunk({"delta": {"content": "Hel"}}), _chunk({"delta": {"content": "lo"}}),
                _chunk({"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {
                    "name": "weather", "arguments": '{"ci'}}]}}),
                _chunk({"delta": {"tool_calls": [{"index": 0, "function": {
                    "arguments": 'ty": "Paris"}'}}]}}),
                _chunk({"delta": {}, "finish_reason": "tool_calls", "stop_reason": None}),
                {"id": "c1", "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4,
                                                      "total_tokens": 13}})
    out = b"".join(a.feed(data[i:i + 7]) for i in range(0, len(data), 7)) + a.end()
    got = json.loads(out)
    assert (got["id"], got["object"], got["created"]) == ("c1", "chat.completion", 7)
    msg = got["choices"][0]["message"]
    assert msg["content"] == "Hello" and got["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": '{"city": "Paris"}'}}]
    assert got["usage"]["completion_tokens"] == 4 and a.usage().estimated is False


def test_an_engine_with_no_usage_is_counted_and_marked() -> None:
    a = Assembler(10, chat=False)
    out = a.feed(_sse(*[{"id": "t", "object": "text_completion", "choices": [
        {"index": 0, "text": w, "finish_reason": None,
         "logprobs": {"tokens": [w], "token_logprobs": [-0.5], "top_logprobs": [{w: -0.5}],
                      "text_offset": [i]}}]} for i, w in enumerate(["a", "b", "c"])])) + a.end()
    got = json.loads(out)
    ch = got["choices"][0]
    assert ch["text"] == "abc" and got["object"] == "text_completion"
    assert ch["logprobs"]["tokens"] == ["a", "b", "c"] and ch["logprobs"]["text_offset"] == [0, 1, 2]
    u = a.usage()
    assert (u.input, u.output, u.estimated) == (10, 3, True)
    assert got["usage"]["completion_tokens"] == 3


def test_a_whole_answer_is_taken_as_it_is() -> None:
    whole = json.dumps({"id": "x", "object": "chat.completion", "choices": [], "usage": {
        "prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}).encode()
    a = Assembler(10, chat=True)
    assert a.feed(b"  " + whole) == b"" and a.end() == b"  " + whole
    assert a.usage().output == 1


def test_a_stop_sequence_finishes_the_answer() -> None:
    a = Assembler(10, chat=True, stops=["END"])
    a.feed(_sse(_chunk({"delta": {"content": "one E"}})))
    assert not a.finished
    a.feed(_sse(_chunk({"delta": {"content": "ND two"}})))
    assert a.finished


def test_the_engine_is_asked_to_stream_with_its_usage() -> None:
    assert streamed({"model": "m", "stream_options": {"x": 1}}) == {
        "model": "m", "stream": True, "stream_options": {"x": 1, "include_usage": True}}


def test_a_delta_with_more_than_its_content_is_read_whole() -> None:
    # The common delta (content only) is read with one look-up; one that also names a
    # role, reasoning or tool calls beside its content loses none of them.
    a = Assembler(10, chat=True)
    a.feed(_sse(_chunk({"delta": {"role": "assistant", "content": "A",
                                  "reasoning_content": "think"}}),
                _chunk({"delta": {"content": "B", "tool_calls": [{"index": 0, "id": "c9",
                        "function": {"name": "f", "arguments": "{}"}}]}}),
                _chunk({"delta": {"reasoning_content": "more"}}),
                _chunk({"delta": {"content": "C"}, "finish_reason": "stop"})))
    got = json.loads(a.end())
    msg = got["choices"][0]["message"]
    assert msg["content"] == "ABC" and msg["reasoning_content"] == "thinkmore"
    assert msg["tool_calls"][0]["id"] == "c9" and a.usage().output == 4
