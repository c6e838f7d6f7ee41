"""The simulated engine: in-process (serve_sim on port 0) and as the real `appliance sim`
process driven by the official `openai` and `ollama` clients."""

from __future__ import annotations

import base64
import json
import signal
import struct
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from appliance.config import SimConfig, SimModel
from appliance.sim.core import is_zero_keep_alive
from appliance.sim.server import FINGERPRINT, VERSION, make_sim_app, serve_sim
from tests.harness.fleet import Fleet

CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "why is the sky blue"}]}
FAIL = "error loading model: unknown model architecture: 'kev'"
NO_TIMEOUT = httpx.Timeout(None)


@asynccontextmanager
async def running_sim(**kw):
    kw.setdefault("tokens_per_second", 0)
    app = make_sim_app(SimConfig(**kw))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_sim, app, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}",
                                     timeout=NO_TIMEOUT) as client:
            yield app.state, client
        nursery.cancel_scope.cancel()


def sse_events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# --- Ollama API --------------------------------------------------------------------------


async def test_ollama_chat_streams_ndjson_and_matches_the_whole_answer():
    async with running_sim() as (_, c):
        r = await c.post("/api/chat", json=CHAT)
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        assert r.headers["x-appliance-engine"] == "sim"
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert len(lines) == 17 and all(not x["done"] for x in lines[:-1])
        last = lines[-1]
        assert last["done"] and last[
            "done_reason"] == "stop" and last["eval_count"] == 16 and last["x_simulated"]
        streamed = "".join(x["message"]["content"] for x in lines)
        whole = (await c.post("/api/chat", json={**CHAT, "stream": False})).json()
        assert whole["message"] == {"role": "assistant", "content": streamed}
        assert len(streamed.split()) == 16


async def test_ollama_generate_num_predict_and_determinism():
    async with running_sim() as (_, c):
        body = {"model": "sim-small", "prompt": "hello", "stream": False,
                "options": {"num_predict": 5}}
        a = (await c.post("/api/generate", json=body)).json()
        b = (await c.post("/api/generate", json=body)).json()
        other = (await c.post("/api/generate", json={**body, "prompt": "goodbye"})).json()
        assert a["response"] == b["response"] and len(a["response"].split()) == 5
        assert other["response"] != a["response"]
        assert a["done_reason"] == "length" and a["eval_count"] == 5 and a["prompt_eval_count"] >= 1
        big = (await c.post("/api/generate", json={**body,
                                                   "options": {"num_predict": 100000}})).json()
        assert big["eval_count"] == 4096


async def test_ollama_metadata_says_simulated():
    async with running_sim(models=[SimModel(name="a", size_mb=300), SimModel(name="b:7b")]) as (_,
                                                                                                c):
        tags = (await c.get("/api/tags")).json()["models"]
        assert [(t["name"], t["model"], t["size"]) for t in tags] == [("a", "a", 300 * 2**20),
                                                                      ("b:7b", "b:7b", 500 * 2**20)]
        assert all(t["details"]["family"] == "sim" for t in tags)
        assert (await c.get("/api/ps")).json() == {"models": []}
        assert (await c.get("/api/version")).json() == {"version": VERSION}
        show = (await c.post("/api/show", json={"model": "a"})).json()
        assert show["details"]["format"] == "sim" and show["x_simulated"]
        assert (await c.post("/api/show", json={"name": "a:latest"})).status_code == 200
        assert "Ollama is running" in (await c.get("/")).text


async def test_load_unload_and_ps():
    async with running_sim() as (state, c):
        r = await c.post("/api/generate", json={"model": "sim-small"})
        assert r.json()["done_reason"] == "load" and state.statistics()["sim-small"]["loaded"]
        ps = (await c.get("/api/ps")).json()["models"]
        assert [m["name"] for m in ps] == ["sim-small"] and ps[0]["size_vram"] == 500 * 2**20
        r = await c.post("/api/chat", json={"model": "sim-small", "messages": [], "keep_alive": 0})
        assert r.json()["done_reason"] == "unload"
        assert (await c.get("/api/ps")).json()["models"] == []
        # A request loads an unloaded model first, as Ollama does; keep_alive 0 unloads after.
        await c.post("/api/generate", json={"model": "sim-small", "prompt": "x", "stream": False})
        assert state.statistics()["sim-small"]["loaded"]
        await c.post("/api/generate", json={"model": "sim-small", "prompt": "x",
                                            "keep_alive": "0s"})
        assert not state.statistics()["sim-small"]["loaded"]


async def test_load_takes_load_seconds(autojump_clock):
    async with running_sim(models=[SimModel(name="slow", load_seconds=30)]) as (state, c):
        start = trio.current_time()
        r = await c.post("/api/generate", json={"model": "slow", "keep_alive": -1})
        assert r.status_code == 200 and r.json()["done_reason"] == "load"
        assert trio.current_time() - start == pytest.approx(30, abs=0.5)
        t = trio.current_time()
        await c.post("/api/generate", json={"model": "slow", "prompt": "x", "stream": False})
        assert trio.current_time() - t < 0.5  # loaded: no second wait
        assert state.statistics()["slow"]["loads"] == 1


async def test_failing_load_answers_500_and_stays_unloaded(autojump_clock):
    models = [SimModel(name="kev", fail_load=FAIL, load_seconds=2), SimModel(name="ok")]
    async with running_sim(models=models) as (state, c):
        start = trio.current_time()
        r = await c.post("/api/generate", json={"model": "kev"})
        assert r.status_code == 500 and r.json() == {"error": FAIL}
        assert trio.current_time() - start == pytest.approx(2, abs=0.5)
        r = await c.post("/api/chat", json={**CHAT, "model": "kev"})
        assert r.status_code == 500 and r.json() == {"error": FAIL}
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "kev"})
        assert r.status_code == 500 and r.json()["error"] == {"message": FAIL,
                                                              "type": "server_error", "param": None,
                                                              "code": "model_load_failed"}
        assert (await c.get("/api/ps")).json()["models"] == []
        assert state.statistics()["kev"] == {"loaded": False, "loads": 3, "generating": 0,
                                             "waiting": 0}


async def test_ollama_embed():
    async with running_sim() as (_, c):
        r = (await c.post("/api/embed", json={"model": "sim-small", "input": ["a", "b"]})).json()
        assert len(r["embeddings"]) == 2 and all(len(v) == 16 for v in r["embeddings"])
        assert r["embeddings"][0] != r["embeddings"][1]
        assert abs(sum(x * x for x in r["embeddings"][0]) - 1) < 1e-9
        one = (await c.post("/api/embed", json={"model": "sim-small", "input": "a"})).json()
        assert one["embeddings"] == r["embeddings"][:1]
        legacy = (await c.post("/api/embeddings", json={"model": "sim-small",
                                                        "prompt": "a"})).json()
        assert legacy["embedding"] == r["embeddings"][0]


# --- OpenAI API --------------------------------------------------------------------------


async def test_openai_chat_stream_sse_with_usage():
    async with running_sim() as (_, c):
        body = {**CHAT, "stream": True, "max_tokens": 7, "stream_options": {"include_usage": True}}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.headers[
            "content-type"] == "text/event-stream" and r.headers["x-appliance-engine"] == "sim"
        ev = sse_events(r.text)
        assert ev[-1] == "[DONE]"
        chunks = ev[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(x["system_fingerprint"] == FINGERPRINT
                   and x["object"] == "chat.completion.chunk" for x in chunks)
        text = "".join(x["choices"][0]["delta"].get("content", "") for x in chunks if x["choices"])
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
        whole = (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 7})).json()
        assert whole[
            "choices"][0]["message"]["content"] == text and whole["object"] == "chat.completion"
        assert whole["usage"]["total_tokens"] == whole["usage"]["prompt_tokens"] + 7
        # The same conversation gives the same words over either API.
        ollama = (await c.post("/api/chat", json={**CHAT, "stream": False,
                                                  "options": {"num_predict": 7}})).json()
        assert ollama["message"]["content"] == text


async def test_stop_sequences_end_the_answer_and_openai_names_the_one_matched():
    async with running_sim() as (_, c):
        full = (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12})).json()
        text = full["choices"][0]["message"]["content"]
        words = text.split()
        # A sequence starting inside a word: the answer is cut right before it.
        stop = words[4][1:] + " " + words[5]
        cut = text[:text.find(stop)]
        body = {**CHAT, "max_tokens": 12, "stop": ["never said", stop]}
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        ch = whole["choices"][0]
        assert ch["message"]["content"] == cut and ch["finish_reason"] == "stop"
        assert ch["stop_reason"] == stop and whole["usage"]["completion_tokens"] == 5
        ev = sse_events((await c.post("/v1/chat/completions",
                                      json={**body, "stream": True})).text)
        assert "".join(x["choices"][0]["delta"].get("content", "") for x in ev[:-1]) == cut
        assert ev[-2]["choices"][0]["finish_reason"] == "stop"
        assert ev[-2]["choices"][0]["stop_reason"] == stop
        # No match: the whole answer, no stop_reason; Ollama's options.stop cuts the same.
        none = (await c.post("/v1/chat/completions", json={**body, "stop": "zzz"})).json()
        assert none["choices"][0]["message"]["content"] == text
        assert "stop_reason" not in none["choices"][0]
        ol = (await c.post("/api/chat", json={**CHAT, "stream": False, "options": {
            "num_predict": 12, "stop": [stop]}})).json()
        assert ol["message"]["content"] == cut and ol["done_reason"] == "stop"
        bad = await c.post("/v1/chat/completions", json={**CHAT, "stop": 5})
        assert bad.status_code == 400


async def test_a_chat_asking_to_think_gets_reasoning_content_first():
    async with running_sim() as (_, c):
        body = {**CHAT, "max_tokens": 5, "chat_template_kwargs": {"enable_thinking": True}}
        whole = (await c.post("/v1/chat/completions", json=body)).json()
        msg = whole["choices"][0]["message"]
        plain = (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})).json()
        assert msg["content"] == plain["choices"][0]["message"]["content"]
        assert len(msg["reasoning_content"].split()) == 4
        assert "reasoning_content" not in plain["choices"][0]["message"]
        assert whole["usage"]["completion_tokens"] == 9
        ev = sse_events((await c.post("/v1/chat/completions",
                                      json={**body, "stream": True})).text)
        deltas = [x["choices"][0]["delta"] for x in ev[:-1] if x["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
        assert [i for i, d in enumerate(deltas) if "reasoning_content" in d] == [1, 2, 3, 4]
        effort = (await c.post("/v1/chat/completions", json={
            **CHAT, "max_tokens": 5, "reasoning_effort": "low"})).json()
        assert effort["choices"][0]["message"]["reasoning_content"] == msg["reasoning_content"]
        off = (await c.post("/v1/chat/completions", json={
            **body, "chat_template_kwargs": {"enable_thinking": False}})).json()
        assert "reasoning_content" not in off["choices"][0]["message"]


async def test_openai_completions_and_models():
    async with running_sim(models=[SimModel(name="a"), SimModel(name="b")]) as (_, c):
        r = (await c.post("/v1/completions", json={"model": "a", "prompt": "once",
                                                   "max_tokens": 3})).json()
        assert r["object"] == "text_completion" and len(r["choices"][0]["text"].split()) == 3
        ev = sse_events((await c.post("/v1/completions", json={"model": "a", "prompt": "once",
                                                               "max_tokens": 3,
                                                               "stream": True})).text)
        assert "".join(x["choices"][0]["text"] for x in ev[:-1]) == r["choices"][0]["text"]
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["a",
                                                     "b"] and models[
                                                         "data"][0]["owned_by"] == FINGERPRINT


async def test_openai_embeddings_float_and_base64():
    async with running_sim() as (_, c):
        f = (await c.post("/v1/embeddings", json={"model": "sim-small", "input": ["x",
                                                                                  "y"]})).json()
        assert [d["index"] for d in f["data"]] == [0, 1] and len(f["data"][0]["embedding"]) == 16
        b = (await c.post("/v1/embeddings", json={"model": "sim-small", "input": "x",
                                                  "encoding_format": "base64"})).json()
        raw = base64.b64decode(b["data"][0]["embedding"])
        assert list(struct.unpack("<16f", raw)) == pytest.approx(f["data"][0]["embedding"],
                                                                 rel=1e-6)


async def test_errors_keep_each_apis_shape():
    async with running_sim() as (_, c):
        r = await c.post("/v1/chat/completions", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await c.post("/v1/chat/completions", content=b"[1]")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await c.post("/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await c.post("/api/chat", content=b"{nope")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
        r = await c.post("/api/generate", json={"prompt": "x"})
        assert r.status_code == 400 and r.json() == {"error": "model is required"}
        r = await c.post("/api/generate", json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "not found" in r.json()["error"]
        assert (await c.get("/api/chat")).status_code == 405
        assert (await c.get("/nowhere")).status_code == 404


# --- time: pacing, slots, disconnects ------------------------------------------------------


async def test_tokens_per_second_paces_the_stream(autojump_clock):
    async with running_sim(tokens_per_second=10) as (_, c):
        start = trio.current_time()
        async with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True,
                                                                  "max_tokens": 20}) as r:
            seen = []
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen.append(trio.current_time() - start)
        assert seen[-1] == pytest.approx(2.0, abs=0.2)  # 20 tokens at 10/s
        assert seen[1] == pytest.approx(0.1, abs=0.05)  # the first token after 1/tps


async def test_parallel_bounds_generation_per_model(autojump_clock):
    async with running_sim(tokens_per_second=10, parallel=2) as (state, c):
        await c.post("/api/generate", json={"model": "sim-small"})
        done: list[float] = []
        start = trio.current_time()

        async def one():
            r = await c.post("/v1/completions", json={"model": "sim-small", "prompt": "p",
                                                      "max_tokens": 10})
            assert r.status_code == 200
            done.append(trio.current_time() - start)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one)
            await trio.sleep(0.5)
            assert state.statistics()["sim-small"]["generating"] == 2
            assert state.statistics()["sim-small"]["waiting"] == 2
        assert sorted(round(d) for d in done) == [1, 1, 2, 2]


async def test_client_that_goes_away_frees_its_slot(autojump_clock):
    async with running_sim(tokens_per_second=1, parallel=1) as (state, c):
        with trio.move_on_after(3):
            async with c.stream("POST", "/api/generate", json={"model": "sim-small",
                                                               "prompt": "x"}) as r:
                async for _ in r.aiter_lines():
                    pass
        await trio.sleep(0.5)
        assert state.statistics()["sim-small"]["generating"] == 0


def test_keep_alive_zero_spellings():
    assert is_zero_keep_alive(
        0) and is_zero_keep_alive("0") and is_zero_keep_alive("0s") and is_zero_keep_alive(0.0)
    assert not is_zero_keep_alive(
        -1) and not is_zero_keep_alive("5m") and not is_zero_keep_alive(None)
    assert not is_zero_keep_alive(False) and not is_zero_keep_alive("soon")


# --- the real process with the official clients --------------------------------------------


@pytest.mark.e2e
def test_appliance_sim_process_with_official_clients(procs):
    import ollama
    import openai

    p = Fleet(procs=procs).start_sim({"Sim__Models__0__Name": "sim-small",
                                      "Sim__Models__1__Name": "kev",
                                      "Sim__Models__1__FailLoad": FAIL})
    oc = openai.OpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    r = oc.chat.completions.create(model="sim-small", messages=CHAT["messages"], max_tokens=8)
    assert r.system_fingerprint == FINGERPRINT and len(r.choices[0].message.content.split()) == 8
    chunks = list(oc.chat.completions.create(model="sim-small", messages=CHAT["messages"],
                                             max_tokens=8, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks
                   if ch.choices) == r.choices[0].message.content
    assert len(oc.completions.create(model="sim-small", prompt="once",
                                     max_tokens=4).choices[0].text.split()) == 4
    emb = oc.embeddings.create(model="sim-small", input="vector")  # the client asks for base64
    assert len(emb.data[0].embedding) == 16
    assert {m.id for m in oc.models.list()} == {"sim-small", "kev"}
    with pytest.raises(openai.NotFoundError):
        oc.chat.completions.create(model="nope", messages=CHAT["messages"])
    with pytest.raises(openai.InternalServerError, match="unknown model architecture"):
        oc.chat.completions.create(model="kev", messages=CHAT["messages"])

    ol = ollama.Client(host=p.url, timeout=30)
    resp = ol.chat(model="sim-small", messages=CHAT["messages"], options={"num_predict": 8})
    assert resp.message.content == r.choices[0].message.content and resp.done_reason == "length"
    parts = list(ol.chat(model="sim-small", messages=CHAT["messages"], stream=True))
    assert parts[-1].done and "".join(x.message.content for x in parts).split().__len__() == 16
    assert ol.generate(model="sim-small", prompt="why").response
    assert len(ol.embed(model="sim-small", input=["a", "b"]).embeddings) == 2
    listed = ol.list().models
    assert {m.model for m in listed} == {"sim-small", "kev"} and listed[0].details.family == "sim"
    assert [m.model for m in ol.ps().models] == ["sim-small"]
    assert ol.show("sim-small").details.family == "sim"
    with pytest.raises(ollama.ResponseError) as e:
        ol.generate(model="kev")
    assert e.value.status_code == 500 and e.value.error == FAIL
    with pytest.raises(ollama.ResponseError) as e:
        ol.chat(model="nope", messages=CHAT["messages"])
    assert e.value.status_code == 404

    p.signal(signal.SIGTERM)
    assert p.wait_exit() == 0
