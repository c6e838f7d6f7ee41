"""End to end: counts, timings, content types and engine errors as clients see them, on
both engine kinds of test_apis_e2e's fleet (`s-chat` on the sim node, passed through;
`o-chat` behind an `openai` node, translated), with the official clients.

- A stream whose client did not ask for usage has no usage chunk (the hub asked the
  engine for it, and dropped it again); one that asked gets it.
- Ollama's counts and durations, whole and streamed, agree and none is 0.
- Anthropic's message_start carries input tokens; the final message the engine's counts.
- A body sent with no content type, or a form's, is served (curl -d, litellm's ollama/).
- Every served request's audit line carries its tokens.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.test_apis_e2e import CHAT_MODELS, USER, fleet  # noqa: F401  (fixture)
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_stream_usage_only_for_a_client_that_asked(fleet, model):  # noqa: F811
    oc = openai.OpenAI(base_url=fleet.hub.url + "/v1", api_key="x", max_retries=0, timeout=30)
    plain = list(oc.chat.completions.create(model=model, messages=USER, max_tokens=6,
                                            stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    asked = list(oc.chat.completions.create(model=model, messages=USER, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 6
    assert asked[-1].usage.prompt_tokens > 0


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_ollama_counts_and_durations_whole_and_streamed(fleet, model):  # noqa: F811
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    whole = ol.chat(model=model, messages=USER, options={"num_predict": 7})
    last = list(ol.chat(model=model, messages=USER, options={"num_predict": 7}, stream=True))[-1]
    for r in (whole, last):
        assert r.eval_count == 7 and r.prompt_eval_count > 0
        assert r.total_duration > 0 and r.eval_duration > 0
        if model.startswith("o-"):  # translated: the hub's clock, every duration counted
            parts = (r.load_duration, r.prompt_eval_duration, r.eval_duration)
            assert all(d > 0 for d in parts) and r.total_duration >= sum(parts)
    assert whole.prompt_eval_count == last.prompt_eval_count


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_anthropic_stream_usage_from_start_to_end(fleet, model):  # noqa: F811
    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="x", max_retries=0, timeout=30)
    with ac.messages.stream(model=model, max_tokens=5, messages=USER) as s:
        events = list(s)
        final = s.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens > 0
    assert final.usage.output_tokens == 5
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) > 0


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_bodies_without_a_json_content_type_are_served(fleet, model):  # noqa: F811
    body = json.dumps({"model": model, "messages": USER, "stream": False,
                       "options": {"num_predict": 3}}).encode()
    for headers in ({}, {"content-type": "application/x-www-form-urlencoded"}):
        r = httpx.post(fleet.hub.url + "/api/chat", content=body, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["done"] is True, r.text
        o = httpx.post(fleet.hub.url + "/v1/chat/completions", headers=headers, timeout=30,
                       content=json.dumps({"model": model, "messages": USER, "max_tokens": 3}))
        assert o.status_code == 200 and o.json()["usage"]["completion_tokens"] == 3


def test_audit_lines_carry_the_tokens(fleet):  # noqa: F811
    oc = openai.OpenAI(base_url=fleet.hub.url + "/v1", api_key="x", max_retries=0, timeout=30)
    for model in CHAT_MODELS:
        list(oc.chat.completions.create(model=model, messages=USER, max_tokens=4, stream=True,
                                        extra_headers={"x-request-id": f"count-{model}"}))
    def lines() -> dict[str, dict]:
        with open(fleet.audit_path) as f:
            return {x.get("request_id"): x for x in map(json.loads, f)}

    # The line is written before the stream's last byte, but the SDK stops reading at
    # `[DONE]`, a chunk earlier: wait for it as any reader of the file would.
    got = wait_until(lambda: (lambda ls: ls if all(f"count-{m}" in ls for m in CHAT_MODELS)
                              else None)(lines()), timeout=10, what="the audit lines")
    for model in CHAT_MODELS:
        line = got[f"count-{model}"]
        assert line["output_tokens"] == 4 and line["input_tokens"] > 0
        assert "tokens_estimated" not in line  # the sim reports its usage
