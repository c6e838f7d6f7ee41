"""Two translation details the rest of the suite let through (issue 22 item 7): a Responses
answer keeps the order its items came in when a tool call comes first, and the context
check counts the prompt's least size rounded up, so a request one token over the context
is refused at exactly the boundary."""

from __future__ import annotations

import json

import pytest

from appliance.http.errors import ApiError
from appliance.hub.translate import ollama, prepare, responses
from tests.hub.translate.test_translate import USAGE, chunk, events, feed_in_pieces, sse

CALL_FIRST = [
    chunk(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                       "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]),
    chunk("Looking it up."), chunk(finish="tool_calls"), USAGE]


def test_responses_stream_with_the_tool_call_first_keeps_that_order():
    conv = responses.ResponsesConverter("m", stream=True, echo={})
    evs = events(feed_in_pieces(conv, sse(*CALL_FIRST), 7))
    added = [(d["output_index"], d["item"]["type"]) for e, d in evs
             if e == "response.output_item.added"]
    assert added == [(0, "function_call"), (1, "message")]
    done = [(d["output_index"], d["item"]["type"]) for e, d in evs
            if e == "response.output_item.done"]
    assert sorted(done) == [(0, "function_call"), (1, "message")]
    output = evs[-1][1]["response"]["output"]
    assert [i["type"] for i in output] == ["function_call", "message"]
    assert output[0]["call_id"] == "call_a" and output[0]["arguments"] == '{"city": "Paris"}'
    assert output[1]["content"][0]["text"] == "Looking it up."


def _chat(prompt_bytes: int, max_tokens: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * prompt_bytes}],
                       "options": {"num_predict": max_tokens}}).encode()


@pytest.mark.parametrize(("prompt_bytes", "prompt"), [(1, 1), (63, 1), (64, 1), (65, 2),
                                                      (127, 2), (128, 2), (129, 3), (6401, 101)])
def test_a_prompt_one_token_over_the_context_is_refused_at_the_boundary(prompt_bytes, prompt):
    # The prompt is at least ceil(bytes / 64) tokens: rounded down, a request one token over
    # the context would pass and the engine would cut it.
    assert ollama.BYTES_PER_TOKEN_MAX == 64
    need = 100 + prompt
    prep = prepare("/api/chat", "ollama", _chat(prompt_bytes, 100), "m", "m")
    assert prep.need == need
    prep.for_engine("llamacpp", need)  # exactly the context: through
    with pytest.raises(ApiError) as ei:
        prep.for_engine("llamacpp", need - 1)  # one token over: refused
    assert ei.value.status == 400 and ei.value.param == "options.num_predict"
    assert f"at least {need} tokens" in ei.value.message and f"({need - 1})" in ei.value.message
