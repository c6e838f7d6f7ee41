"""A client that asked for one answer and leaves frees the engine (issue 31 item 2).

In-process: a hub in front of a fake llama.cpp node whose engine behaves as llama-server
does -- a whole answer is generated to its end whoever still waits, a stream stops when
its reader closes it. On every generating route (chat and text completions, Anthropic's
messages, OpenAI's responses, Ollama's chat and generate) the engine is asked to stream,
and a client that gives up at 0.5 s has the engine's stream closed at once (the virtual
clock's 3 s answer not run to its end);
a client that waits gets the whole answer the hub assembled from the stream (text, usage).
The llama-server half is tests/test_leaving_frees_engine_llama.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from appliance.http.asgi import read_body
from appliance.http.stream import cancel_on_disconnect
from tests.harness.engine_hub import hub_before

PIECES = 300  # at 10 ms a piece the answer takes 3 s
USER = [{"role": "user", "content": "tell me a story"}]
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": USER},
    "/v1/completions": {"prompt": "once upon a time"},
    "/v1/messages": {"messages": USER, "max_tokens": PIECES},
    "/v1/responses": {"input": "tell me a story"},
    "/api/chat": {"messages": USER, "stream": False},
    "/api/generate": {"prompt": "once upon a time", "stream": False},
}


def _chunk(chat: bool, piece: dict[str, Any], finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    choice.update({"delta": piece} if chat else {"text": piece.get("content", "")})
    c = {"id": "c1", "object": "chat.completion.chunk" if chat else "text_completion",
         "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(c).encode() + b"\n\n"


class Engine:
    """llama-server's manners: a whole answer is made to its end (no hang-up watch), a
    stream ends when its reader goes. `pieces` per answer, one every `gap` seconds."""

    def __init__(self, pieces: int = PIECES, gap: float = 0.01) -> None:
        self.pieces, self.gap = pieces, gap
        self.bodies: list[dict[str, Any]] = []
        self.closed = trio.Event()  # a stream's reader went before its end
        self.whole_running = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = json.loads(await read_body(receive, 1 << 20))
        self.bodies.append(body)
        chat = scope["path"] == "/v1/chat/completions"
        if not body.get("stream"):
            self.whole_running += 1
            await trio.sleep(self.pieces * self.gap)
            self.whole_running -= 1
            answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                      "choices": [{"index": 0, "finish_reason": "length",
                                   "message": {"role": "assistant", "content": "x" * 10}}],
                      "usage": {"prompt_tokens": 5, "completion_tokens": self.pieces,
                                "total_tokens": 5 + self.pieces}}
            data = json.dumps(answer).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async with cancel_on_disconnect(receive, scope=scope) as gone:
            for i in range(self.pieces):
                await send({"type": "http.response.body", "more_body": True,
                            "body": _chunk(chat, {"content": f"w{i} "})})
                await trio.sleep(self.gap)
            usage = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": self.pieces,
                                              "total_tokens": 5 + self.pieces}}
            tail = (_chunk(chat, {}, "length") + b"data: " + json.dumps(usage).encode()
                    + b"\n\ndata: [DONE]\n\n")
            await send({"type": "http.response.body", "body": tail})
        if gone.gone:
            self.closed.set()


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_client_that_leaves_closes_the_engines_stream(tmp_path: Path, route: str,
                                                             autojump_clock: Any) -> None:
    engine = Engine()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        async with httpx.AsyncClient(timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(url + route, json={"model": "m", **ROUTES[route]})
        left = trio.current_time()
        with trio.fail_after(10):
            await engine.closed.wait()
        # At once on the virtual clock: the engine's whole answer would take 3 s.
        assert trio.current_time() - left < 0.1
        nursery.cancel_scope.cancel()
    assert engine.bodies[0]["stream"] is True and engine.whole_running == 0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_one_answer_is_assembled_from_the_engines_stream(tmp_path: Path,
                                                              route: str) -> None:
    engine = Engine(pieces=5, gap=0)
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(url + route, json={"model": "m", **ROUTES[route]})
        nursery.cancel_scope.cancel()
    got = r.json()
    ch = got["choices"][0]
    text = ch["message"]["content"] if route.endswith("chat/completions") else ch["text"]
    assert text == "w0 w1 w2 w3 w4 " and ch["finish_reason"] == "length"
    assert got["object"] == ("chat.completion" if "chat" in route else "text_completion")
    assert got["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    assert r.headers["content-length"] == str(len(r.content))
