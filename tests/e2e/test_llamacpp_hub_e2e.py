"""End to end with real llama.cpp: a hub and two `Engine__Kind=llamacpp` nodes.

One fleet per real server (each real process costs a second or two of this machine's two
cores; tests/conftest.py's `real_server`: llama.cpp's own `llama-server`, then
llama-cpp-python's `python -m llama_cpp.server`, both from the cached builds): gpu-a
(2000 MiB) and gpu-b (1000 MiB), and a catalog of three on-demand models -- `tiny` (the seeded GGUF
of tests/harness/make_gguf.py, unloaded after 3 idle seconds), `kev` (its copy that llama.cpp
refuses) and `huge` (the same file declared at 50000 MiB, above every node). Requests go
through the hub with the official `openai` client; status comes from `/api/status`.
"""

from __future__ import annotations

import importlib.util
import json
import re

import httpx
import openai
import pytest

from tests.harness import make_gguf
from tests.harness.fleet import Fleet
from tests.harness.llama_cache import RealServer
from tests.harness.procs import wait_until
from tests.node.engines.test_llamacpp_engine import alive
from tests.node.engines.test_llamacpp_real import KEV_LINE, engine_children

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

TOKEN = "llama-fleet-secret"
IDLE_UNLOAD = 3
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, real_server: RealServer):
    tiny, kev = make_gguf.write_pair(tmp_path_factory.mktemp("gguf"), seed=11)
    f = Fleet(token=TOKEN)
    f.server = real_server
    try:
        # A Python llama_cpp.server starting on a busy 2-core box can take over a minute:
        # generous start and activation waits (the cases are about behaviour, not speed).
        node_env = {"Engine__Kind": "llamacpp", "Engine__Command": real_server.command,
                    "Engine__StartTimeoutSeconds": "150"}
        a = f.start_node("gpu-a", {**node_env, "Node__MemoryMb": "2000"}, announce=False)
        b = f.start_node("gpu-b", {**node_env, "Node__MemoryMb": "1000"}, announce=False)
        f.start_hub({
            "Hub__ControlIntervalSeconds": "0.2", "Router__ActivationWaitSeconds": "150",
            "Nodes__0__Name": "gpu-a", "Nodes__0__Url": a.url,
            "Nodes__1__Name": "gpu-b", "Nodes__1__Url": b.url,
            "Models__0__Name": "tiny", "Models__0__Source": str(tiny),
            "Models__0__IdleUnloadSeconds": str(IDLE_UNLOAD),
            "Models__1__Name": "kev", "Models__1__Source": str(kev),
            "Models__2__Name": "huge", "Models__2__Source": str(tiny),
            "Models__2__MemoryMb": "50000",
            # Keep five real failures quick: the backoff between attempts is capped at 0.5 s.
            "Models__RetryBackoffMaxSeconds": "0.5",
        }, metrics=False)
        f.client = f.openai(timeout=180)
        f.wait(lambda: len(f.nodes()) == 2 and all(n["status"] == "up"
                                                   for n in f.nodes().values()),
               "both nodes up")
        yield f
    finally:
        f.close()


def test_cold_model_streams_through_the_hub_then_idles_out(fleet):
    pieces = [chunk.choices[0].delta.content
              for chunk in fleet.client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                                max_tokens=16, stream=True)
              if chunk.choices and chunk.choices[0].delta.content]
    assert len(pieces) >= 2
    r = fleet.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8)
    assert r.choices[0].message.content
    (where,) = fleet.models()["tiny"]["nodes"]
    node = fleet.node(where)
    (engine,) = engine_children(node.pid, fleet.server.marker)
    _same_stream_as_the_engine_alone(fleet, node)
    # Idle for IdleUnloadSeconds: the hub unloads it and the process is gone.
    wait_until(lambda: fleet.models()["tiny"]["ready"] == 0, IDLE_UNLOAD + 15,
               "tiny unloaded when idle")
    wait_until(lambda: not alive(engine), 15, f"engine pid {engine} stopped")
    assert engine_children(node.pid, fleet.server.marker) == []


def test_openai_client_chat_through_the_hub(fleet):
    """The official `openai` client through the hub to a node's real server, whole and
    streamed: an assistant message, a finish reason, token counts; asked for, the stream's
    last chunk carries the usage (llama-server sends it; llama_cpp.server sends none)."""
    r = fleet.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                             temperature=0, seed=3)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    chunks = list(fleet.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, seed=3, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert text and finish == [choice.finish_reason]
    if fleet.server.name == "llama-server":
        assert text == choice.message.content  # greedy: the same text both ways
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_too_large_is_answered_at_once_with_its_numbers(fleet):
    # (how fast: bench/refusals.py)
    with pytest.raises(openai.APIStatusError) as err:
        fleet.client.chat.completions.create(model="huge", messages=MESSAGES, max_tokens=4)
    assert err.value.status_code == 503
    assert "50000 MiB" in str(err.value) and "gpu-a" in str(err.value)
    m = fleet.models()["huge"]
    assert m["unplaceable"] and "50000 MiB" in m["reason"] and not m["parked"]
    assert fleet.loads("huge") == 0


def test_kev_is_parked_after_five_real_failures(fleet):
    with pytest.raises(openai.APIStatusError) as err:
        fleet.client.chat.completions.create(model="kev", messages=MESSAGES, max_tokens=4)
    assert err.value.status_code == 503
    wait_until(lambda: fleet.models()["kev"]["parked"], 60, "kev parked")
    m = fleet.models()["kev"]
    assert m["consecutive_start_failures"] == 5
    assert KEV_LINE in m["last_error"] and "Traceback" not in m["last_error"]
    # Each round tries kev on every capable node (gpu-a and gpu-b) before it counts as one
    # failure (hub/decide/placement.py): five rounds, ten starts.
    assert fleet.loads("kev") == 5 * 2
    # Parked: answered with llama.cpp's own words, no Retry-After, no further start (how
    # fast: bench/refusals.py).
    r = fleet.chat("kev", max_tokens=4, timeout=10)
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.json()["error"]["code"] == "model_parked" and KEV_LINE in r.json()["error"]["message"]
    assert fleet.loads("kev") == 5 * 2


@pytest.mark.skipif(importlib.util.find_spec("appliance.ctl") is None,
                    reason="appliance ctl not built yet")
def test_ctl_retry_tries_kev_again(fleet):
    wait_until(lambda: fleet.models()["kev"]["parked"], 60, "kev parked")
    before = fleet.loads("kev")
    code, said = fleet.ctl("retry", "kev")
    assert code == 0, said
    with pytest.raises(openai.APIStatusError):
        fleet.client.chat.completions.create(model="kev", messages=MESSAGES, max_tokens=4)
    wait_until(lambda: fleet.loads("kev") > before, 30, "kev tried again after ctl retry")


def _same_stream_as_the_engine_alone(fleet, node) -> None:
    """A greedy stream through hub and node carries the engine's events, all of them, in order.

    (Its speed against the engine alone is measured by bench/llamacpp.py, not here.)
    """
    port = next(re.search(r"on port (\d+)", ln).group(1) for ln in reversed(list(node.stderr_lines))
                if "serves tiny on port" in ln)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 32, "stream": True,
            "temperature": 0, "seed": 3}

    def deltas(url: str) -> list[str]:
        out = []
        with httpx.stream("POST", url, json=body, timeout=180) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    out.append(choice["delta"].get("content") or "")
        return out

    via_hub = deltas(fleet.hub.url + "/v1/chat/completions")
    direct = deltas(f"http://127.0.0.1:{port}/v1/chat/completions")
    assert len(via_hub) >= 8 and "".join(via_hub) and via_hub == direct


def test_ollama_anthropic_and_responses_clients_on_a_llamacpp_model(fleet):
    """llama.cpp speaks only OpenAI: the hub translates, and greedy text is the same
    streamed and whole on every API."""
    import anthropic
    import ollama

    ol = ollama.Client(host=fleet.hub.url, timeout=180)
    opts = {"temperature": 0, "seed": 3, "num_predict": 12}
    whole = ol.chat(model="tiny", messages=MESSAGES, options=opts)
    show = ol.show("tiny")  # from the GGUF's header, read by the node
    assert show.details.format == "gguf" and show.modelinfo[
        "llama.context_length"] == make_gguf.N_CTX
    parts = list(ol.chat(model="tiny", messages=MESSAGES, options=opts, stream=True))
    assert whole.message.content and "".join(p.message.content
                                             for p in parts) == whole.message.content
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length") and whole.eval_count > 0
    g = ol.generate(model="tiny", prompt="hi", options=opts)
    assert g.done and isinstance(g.response, str)
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="tiny", messages=MESSAGES, options={"temperature": "hot"})
    assert ei.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as ei:  # the GGUF's context: no silent cut
        ol.chat(model="tiny", messages=MESSAGES, options={"num_predict": make_gguf.N_CTX,
                                                          "num_ctx": 4 * make_gguf.N_CTX})
    assert ei.value.status_code == 400 and f"({make_gguf.N_CTX})" in ei.value.error

    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0, timeout=180)
    m = ac.messages.create(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                           messages=MESSAGES)
    with ac.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                            messages=MESSAGES) as s:
        text = "".join(s.text_stream)
    assert m.content and text == m.content[0].text and m.stop_reason in ("end_turn", "max_tokens")

    r = fleet.client.responses.create(model="tiny", input="hi", max_output_tokens=12, temperature=0)
    deltas = [e.delta for e in fleet.client.responses.create(model="tiny", input="hi",
                                                             max_output_tokens=12,
                                                              temperature=0, stream=True)
              if e.type == "response.output_text.delta"]
    assert r.output_text and "".join(deltas) == r.output_text


def test_langchain_chat_models_on_a_llamacpp_model(fleet):
    """The tiny model's random tokens split multi-byte characters; llama.cpp streams such a
    fragment as U+FFFD while its whole answer joins it (the engine's own doing: the
    passed-through OpenAI stream shows it too), so the ASCII of both is compared."""
    from langchain_ollama import ChatOllama
    from langchain_openai import ChatOpenAI

    for chat in (ChatOllama(model="tiny", base_url=fleet.hub.url, num_predict=10, temperature=0,
                            seed=3),
                 ChatOpenAI(model="tiny", base_url=fleet.hub.url + "/v1", api_key="anyone",
                            max_tokens=10,
                            temperature=0, seed=3, max_retries=0, timeout=180)):
        whole = chat.invoke("hi")
        streamed = "".join(c.content for c in chat.stream("hi"))
        ascii_only = lambda s: "".join(ch for ch in s if ord(ch) < 128)  # noqa: E731
        assert ascii_only(whole.content) and ascii_only(
            streamed) == ascii_only(whole.content), type(chat).__name__
