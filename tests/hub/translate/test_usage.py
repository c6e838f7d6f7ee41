"""Counts and timings that are true (translate/usage.py and the converters): the engine's
usage read from every answer, passed through or translated; asked for on streams and
its chunk dropped again when the client did not ask; counted by the hub (marked
estimated) where the engine gives none; Ollama's durations from the hub's clock."""

from __future__ import annotations

import json
from typing import Any

import pytest

from appliance.hub.translate import anthropic, ollama, prepare, responses
from appliance.hub.translate.common import Start
from appliance.hub.translate.usage import (
    WHOLE_LIMIT,
    JSONMeter,
    NDJSONMeter,
    SSEMeter,
    Usage,
    prompt_estimate,
)

USER = [{"role": "user", "content": "x" * 40}]  # 40 bytes: 10 tokens at 4 bytes a token


def sse(*objs: Any, done: bool = True) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + (
        b"data: [DONE]\n\n" if done else b"")


def chunk(content: str | None = None, finish: str | None = None) -> dict[str, Any]:
    delta = {} if content is None else {"content": content}
    return {"id": "c", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"id": "c", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 3,
                                             "total_tokens": 14,
                                             "prompt_tokens_details": {"cached_tokens": 8}}}
STREAM = [chunk(""), chunk("Hel"), chunk("lo"), chunk("!"), chunk(finish="stop")]


def pieces(conv: Any, data: bytes, size: int) -> bytes:
    return b"".join(conv.feed(data[i:i + size]) for i in range(0, len(data), size)) + conv.end()


# --- passed through --------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 7, 100, 10**6])
def test_sse_meter_drops_only_the_usage_chunk_it_asked_for(size: int) -> None:
    data = sse(*STREAM, USAGE)
    m = SSEMeter(prompt=99, drop=True)
    assert pieces(m, data, size) == sse(*STREAM)
    assert m.usage() == Usage(11, 3, 8, estimated=False, cache=(11, 8))
    kept = SSEMeter(prompt=99, drop=False)  # the client asked: every byte passes
    assert pieces(kept, data, size) == data and kept.usage() == Usage(11, 3, 8, cache=(11, 8))


def test_sse_meter_with_crlf_events_and_an_engine_that_gives_no_usage() -> None:
    data = sse(*STREAM).replace(b"\n\n", b"\r\n\r\n")
    m = SSEMeter(prompt=10, drop=True)
    assert pieces(m, data, 5) == data
    # llama-cpp-python ignores include_usage: one token a generated chunk, the prompt estimated
    assert m.usage() == Usage(10, 3, 0, estimated=True)


def test_sse_meter_passes_what_is_no_event_and_never_holds_a_huge_line() -> None:
    m = SSEMeter(prompt=1, drop=True)
    junk = b"x" * (2 * 1024 * 1024)
    assert m.feed(junk) == junk  # over the event bound: passed on unparsed
    assert m.feed(b": keep-alive\n\n") == b": keep-alive\n\n"


def test_ndjson_meter_reads_ollamas_last_line_or_counts_lines() -> None:
    lines = [{"message": {"content": "a"}, "done": False}] * 4 + [
        {"done": True, "prompt_eval_count": 12, "eval_count": 4}]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    m = NDJSONMeter(prompt=3)
    assert pieces(m, data, 9) == data and m.usage() == Usage(12, 4)
    bare = NDJSONMeter(prompt=3)
    pieces(bare, b"".join(json.dumps(x).encode() + b"\n" for x in lines[:-1]) + b'{"done":true}',
           4)
    assert bare.usage() == Usage(3, 4, 0, estimated=True)


def test_json_meter_whole_answers_small_and_huge() -> None:
    body = json.dumps({"choices": [{"message": {"content": "hello"}}],
                       "usage": USAGE["usage"]}).encode()
    m = JSONMeter(prompt=5, api="openai")
    assert pieces(m, body, 3) == body and m.usage() == Usage(11, 3, 8, cache=(11, 8))
    none = JSONMeter(prompt=5, api="openai")
    pieces(none, json.dumps({"choices": [{"message": {"content": "x" * 20}}]}).encode(), 50)
    assert none.usage() == Usage(5, 5, 0, estimated=True)
    # An embedding answer over WHOLE_LIMIT: its usage read from the tail (vLLM's order).
    vec = json.dumps({"data": [{"embedding": [0.123456] * (WHOLE_LIMIT // 8)}],
                      "usage": {"prompt_tokens": 6, "total_tokens": 6}}).encode()
    big = JSONMeter(prompt=5, api="openai")
    assert len(pieces(big, vec, 1 << 20)) == len(vec) > WHOLE_LIMIT
    assert big.usage() == Usage(6, 0)
    ol = JSONMeter(prompt=5, api="ollama")
    pieces(ol, b'{"message":{"content":"hi"},"done":true,"prompt_eval_count":9,"eval_count":2}',
           10)
    assert ol.usage() == Usage(9, 2)


def test_prepare_asks_for_the_stream_usage_only_when_the_client_did_not() -> None:
    def plan(obj: dict[str, Any]) -> Any:
        return prepare("/v1/chat/completions", "openai", json.dumps(obj).encode(), "m",
                       "m").for_engine("llamacpp")

    asked = plan({"model": "m", "messages": USER, "stream": True})
    assert json.loads(asked.body)["stream_options"] == {"include_usage": True}
    assert asked.drop_usage and asked.prompt == prompt_estimate(json.dumps(
        {"model": "m", "messages": USER, "stream": True}).encode())
    own = {"model": "m", "messages": USER, "stream": True,
           "stream_options": {"include_usage": True}}
    assert not plan(own).drop_usage and json.loads(plan(own).body) == own
    whole = {"model": "m", "messages": USER}
    # One answer: the engine streams it with its usage, the hub assembles it (assemble.py).
    assert json.loads(plan(whole).body) == {**whole, "stream": True,
                                            "stream_options": {"include_usage": True}}
    assert not plan(whole).drop_usage
    emb = prepare("/v1/embeddings", "openai", b'{"model":"m","input":["abcd","efgh"]}', "m", "m")
    assert emb.prompt == 10  # 37 bytes: the body's JSON counts too (no tokenizer here)


def test_prompt_estimate_counts_text_not_images_in_every_api() -> None:
    text = {"model": "m", "messages": [{"role": "user", "content": "a" * 400}]}
    base = prompt_estimate(json.dumps(text).encode())
    assert 100 <= base <= 110
    png = "iVBORw0KGgo" + "A" * 40_000
    openai_img = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a" * 400},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png}}]}]}
    anthropic_img = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a" * 400},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": png}}]}]}
    ollama_img = {"model": "m", "messages": [{"role": "user", "content": "a" * 400,
                                              "images": [png, png]}]}
    for obj in (openai_img, anthropic_img, ollama_img):
        assert base <= prompt_estimate(json.dumps(obj).encode()) <= base + 40, obj["messages"][0]
    # A million tiny messages: the JSON around each is not counted, and it takes no time.
    many = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 10**6})
    assert prompt_estimate(many.encode()) < 10**6


# --- Ollama's counts and durations -----------------------------------------------------


class Clock:
    def __init__(self, t: int) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


@pytest.mark.parametrize("stream", [True, False])
def test_ollama_durations_come_from_the_hubs_clock(stream: bool) -> None:
    clock = Clock(5_000)
    # The request came at 1,000 ns, went to the node at 3,000 (the hub's own wait: load).
    conv = ollama.ChatConverter("m", stream, True, Start(1_000, 3_000), clock=clock, prompt=10)
    out = conv.feed(sse(chunk(""), done=False))
    clock.t = 10_000  # the first token
    out += conv.feed(sse(chunk("Hel"), done=False))
    clock.t = 50_000
    out += conv.feed(sse(chunk("lo"), chunk(finish="length"), USAGE))
    out += conv.end()
    lines = [json.loads(x) for x in out.splitlines()]
    last = lines[-1]
    if stream:
        assert [x["message"]["content"] for x in lines] == ["Hel", "lo", ""]
    else:
        assert len(lines) == 1 and last["message"]["content"] == "Hello"
    assert last["done"] and last["done_reason"] == "length"
    assert (last["load_duration"], last["prompt_eval_duration"], last["eval_duration"],
            last["total_duration"]) == (2_000, 7_000, 40_000, 49_000)
    assert (last["prompt_eval_count"], last["eval_count"]) == (11, 3)
    assert conv.usage() == Usage(11, 3, 8, cache=(11, 8))


def test_ollama_counts_without_engine_usage_and_llama_timings() -> None:
    clock = Clock(0)
    conv = ollama.ChatConverter("m", False, False, Start(1, 2), clock=clock, prompt=10)
    clock.t = 100
    last_chunk = {**chunk(finish="stop"), "timings": {"prompt_ms": 0.5, "predicted_ms": 2.0}}
    conv.feed(sse(chunk("a"), chunk("b"), last_chunk))
    clock.t = 10**7
    last = json.loads(conv.end())
    assert last["response"] == "ab" and last["context"] == []
    assert (last["prompt_eval_count"], last["eval_count"]) == (10, 2)
    assert conv.usage() == Usage(10, 2, 0, estimated=True)
    assert (last["prompt_eval_duration"], last["eval_duration"]) == (500_000, 2_000_000)
    assert last["total_duration"] >= last["load_duration"] + 2_500_000


def test_ollama_answer_given_whole_and_tool_calls_gathered_for_one_answer() -> None:
    whole = {"choices": [{"message": {"content": "hi", "tool_calls": [
        {"id": "a", "function": {"name": "w", "arguments": '{"c": 1}'}}]},
        "finish_reason": "tool_calls"}], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    conv = ollama.ChatConverter("m", False, True, prompt=1)
    conv.feed(json.dumps(whole).encode())
    last = json.loads(conv.end())
    assert last["message"]["tool_calls"] == [{"function": {"name": "w", "arguments": {"c": 1}}}]
    assert (last["prompt_eval_count"], last["eval_count"]) == (4, 2)
    assert min(last[k] for k in ("total_duration", "load_duration", "prompt_eval_duration",
                                 "eval_duration")) >= 1
    streamed = ollama.ChatConverter("m", False, True, prompt=1)
    calls = [{"index": 0, "id": "a", "function": {"name": "w", "arguments": '{"c"'}},
             {"index": 0, "function": {"arguments": ": 1}"}}]
    streamed.feed(sse(*({"choices": [{"index": 0, "delta": {"tool_calls": [c]}}]}
                        for c in calls)))
    assert json.loads(streamed.end())["message"]["tool_calls"] == [
        {"function": {"name": "w", "arguments": {"c": 1}}}]
    assert streamed.usage() == Usage(1, 2, 0, estimated=True)


# --- Anthropic and Responses -----------------------------------------------------------


def events(out: bytes) -> list[tuple[str, dict[str, Any]]]:
    got = []
    for block in out.decode().split("\n\n"):
        lines = dict(x.split(": ", 1) for x in block.splitlines() if ": " in x)
        if "data" in lines:
            got.append((lines.get("event", ""), json.loads(lines["data"])))
    return got


def test_anthropic_stream_usage_start_estimate_then_engine_counts() -> None:
    conv = anthropic.MessagesConverter("m", True, prompt=10)
    evs = events(pieces(conv, sse(*STREAM, USAGE), 11))
    start = evs[0][1]["message"]["usage"]
    assert start == {"input_tokens": 10, "output_tokens": 0}
    (delta,) = [d for e, d in evs if e == "message_delta"]
    # Anthropic's input_tokens leave out what was read from the cache.
    assert delta["usage"] == {"input_tokens": 3, "output_tokens": 3,
                              "cache_read_input_tokens": 8}
    assert conv.usage() == Usage(11, 3, 8, cache=(11, 8))
    bare = anthropic.MessagesConverter("m", True, prompt=0)
    evs = events(pieces(bare, sse(*STREAM), 64))
    assert evs[0][1]["message"]["usage"]["input_tokens"] == 1  # never a 0
    assert [d for e, d in evs if e == "message_delta"][0]["usage"]["output_tokens"] == 3
    assert bare.usage() == Usage(0, 3, 0, estimated=True)


def test_anthropic_whole_answer_usage_and_random_ids() -> None:
    body = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}}
    a, b = (anthropic.MessagesConverter("m", False, prompt=9) for _ in range(2))
    out = json.loads(pieces(a, json.dumps(body).encode(), 5))
    assert out["usage"] == {"input_tokens": 5, "output_tokens": 1}
    assert a.id != b.id and a.id.startswith("msg_") and len(a.id) == 28


def test_anthropic_output_config_format_becomes_response_format() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    base = {"model": "m", "max_tokens": 5, "messages": USER}
    for key in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                {"output_format": {"type": "json_schema", "schema": schema}}):
        req, _ = anthropic.request({**base, **key}, "m")
        assert req["response_format"] == {"type": "json_schema", "json_schema": {
            "name": "output", "schema": schema, "strict": True}}
    for bad, param in (({"output_config": 3}, "output_config"),
                       ({"output_config": {"format": {"type": "xml"}}},
                        "output_config.format.type"),
                       ({"output_config": {"format": {"type": "json_schema"}}},
                        "output_config.format.schema")):
        with pytest.raises(Exception) as e:
            anthropic.request({**base, **bad}, "m")
        assert getattr(e.value, "param", None) == param and e.value.status == 400  # type: ignore[attr-defined]


def test_responses_incomplete_when_the_cap_cut_the_answer() -> None:
    cut = [chunk("Hel"), chunk(finish="length"), USAGE]
    conv = responses.ResponsesConverter("m", True, {}, prompt=4)
    evs = events(pieces(conv, sse(*cut), 13))
    kind, last = evs[-1]
    assert kind == "response.incomplete" and last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][0]["status"] == "incomplete"
    assert last["response"]["usage"]["input_tokens_details"] == {"cached_tokens": 8}
    whole = {"choices": [{"message": {"content": "Hel"}, "finish_reason": "length"}]}
    out = json.loads(pieces(responses.ResponsesConverter("m", False, {}, prompt=4),
                            json.dumps(whole).encode(), 9))
    assert out["status"] == "incomplete" and out["usage"]["input_tokens"] == 4
    done = events(pieces(responses.ResponsesConverter("m", True, {}), sse(*STREAM, USAGE), 50))
    assert done[-1][0] == "response.completed"
    assert done[-1][1]["response"]["incomplete_details"] is None
    assert done[-1][1]["response"]["usage"]["output_tokens"] == 3


def test_responses_ids_are_random_and_text_format_is_mapped_and_echoed() -> None:
    ids = {responses.ResponsesConverter("m", False, {}).id for _ in range(50)}
    assert len(ids) == 50
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    req, _, echo = responses.request({"model": "m", "input": "x", "text": {"format": fmt}}, "m")
    assert req["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}
    assert echo["text"] == {"format": fmt}
    for bad in ({"format": {"type": "yaml"}}, {"format": {"type": "json_schema"}}, "x"):
        with pytest.raises(Exception) as e:
            responses.request({"model": "m", "input": "x", "text": bad}, "m")
        assert e.value.status == 400  # type: ignore[attr-defined]
