"""Usage on the hub's request path, in-process against a fake engine node: the stream's
usage is asked for and its chunk dropped again for a client that did not ask (the
`openai` client sees no usage chunk), kept for one that did; the answer's usage lands on
the request record (the audit line's tokens, cached tokens) -- counted by the hub and
marked estimated where the engine gives none; Ollama's counts and durations over a
translation are non-zero and agree between streamed and whole answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import trio

from appliance.http.asgi import read_body
from tests.harness.engine_hub import hub_before

USAGE = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 8}}
WORDS = ["Hel", "lo", "!"]


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    c = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(c).encode() + b"\n\n"


class Engine:
    """An OpenAI-speaking engine: usage on streams when asked (llama-server), or never
    (`usage=False`: llama-cpp-python)."""

    def __init__(self, usage: bool = True) -> None:
        self.usage = usage
        self.bodies: list[dict[str, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.loads(await read_body(receive, 1 << 20))
        self.bodies.append(body)
        if not body.get("stream"):
            answer: dict[str, Any] = {
                "id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "".join(WORDS)}}]}
            if self.usage:
                answer["usage"] = USAGE
            data = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        parts = [_chunk({"role": "assistant", "content": ""})]
        parts += [_chunk({"content": w}) for w in WORDS]
        parts.append(_chunk({}, "stop"))
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            u = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [], "usage": USAGE}
            parts.append(b"data: " + json.dumps(u).encode() + b"\n\n")
        parts.append(b"data: [DONE]\n\n")
        for p in parts:
            await send({"type": "http.response.body", "body": p, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _audit(tmp: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (tmp / "audit.log").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "request"]


USER = [{"role": "user", "content": "what is the weather in Paris?"}]


async def test_stream_usage_asked_for_and_dropped_unless_the_client_asked(tmp_path: Path) -> None:
    engine = Engine()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)
        plain = [c async for c in await oc.chat.completions.create(
            model="m", messages=USER, stream=True)]  # type: ignore[arg-type]
        asked = [c async for c in await oc.chat.completions.create(
            model="m", messages=USER, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})]
        whole = await oc.chat.completions.create(model="m", messages=USER)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
    # One answer asked for: streamed from the engine too, and assembled (assemble.py).
    assert all(b["stream_options"] == {"include_usage": True} for b in engine.bodies[:3])
    assert engine.bodies[2]["stream"] is True
    assert [c.usage for c in plain] == [None] * len(plain) and plain[-1].choices
    assert "".join(c.choices[0].delta.content or "" for c in plain) == "Hello!"
    assert asked[-1].choices == [] and asked[-1].usage is not None
    assert asked[-1].usage.prompt_tokens == 11
    assert whole.usage is not None and whole.usage.completion_tokens == 3
    for line in _audit(tmp_path):
        assert (line["input_tokens"], line["output_tokens"], line["cached_tokens"]) == (11, 3, 8)
        assert "tokens_estimated" not in line


async def test_an_engine_without_usage_is_counted_and_marked(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, Engine(usage=False))
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(url + "/v1/chat/completions",
                             json={"model": "m", "messages": USER, "stream": True})
            m = await c.post(url + "/v1/messages", json={"model": "m", "messages": USER,
                                                         "max_tokens": 50, "stream": True})
        nursery.cancel_scope.cancel()
    assert r.text.endswith("data: [DONE]\n\n")
    start = json.loads(m.text.split("data: ", 2)[1].split("\n")[0])
    assert start["message"]["usage"]["input_tokens"] > 0
    delta = [json.loads(x.split("data: ", 1)[1]) for x in m.text.split("\n\n")
             if "message_delta" in x]
    assert delta[0]["usage"]["output_tokens"] == len(WORDS)
    for line in _audit(tmp_path):
        assert line["tokens_estimated"] is True and line["output_tokens"] == len(WORDS)
        assert line["input_tokens"] > 0


async def test_ollama_counts_and_durations_over_a_translation(tmp_path: Path) -> None:
    engine = Engine()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        ac = ollama.AsyncClient(host=url, timeout=20)
        whole = await ac.chat(model="m", messages=USER)
        parts = [p async for p in await ac.chat(model="m", messages=USER, stream=True)]
        nursery.cancel_scope.cancel()
    # The engine is asked to stream either way: the first token splits the durations.
    assert [b["stream"] for b in engine.bodies] == [True, True]
    last = parts[-1]
    assert whole.message.content == "".join(p.message.content for p in parts) == "Hello!"
    for r in (whole, last):
        assert (r.prompt_eval_count, r.eval_count) == (11, 3)
        durations = (r.load_duration, r.prompt_eval_duration, r.eval_duration)
        assert all(d is not None and d > 0 for d in durations)
        assert r.total_duration is not None and r.total_duration >= sum(
            d for d in durations if d is not None)
