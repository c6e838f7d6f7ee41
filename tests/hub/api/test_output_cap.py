"""A key with a token limit sends no request without an output cap (issue 30 item 3).

In-process hub, a fake node that records what it is sent and answers as many output
tokens as the request allows (4096, the sim's most, when it names no cap or a negative
one). Without a cap written in, four concurrent `num_predict: -1` chats of a key with
Tpm=5000 settled ~16,000 tokens in the minute.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from appliance.config import ClientConfig
from appliance.http.asgi import Receive, Scope, Send, read_body
from appliance.hub.decide.limits import Limiter
from appliance.hub.run import Hub
from appliance.hub.translate.outcap import ROOM, with_cap
from appliance.wire import NodeState
from tests.harness.engine_hub import M_READY, hub_before

UNCAPPED = 4096  # what the fake engine generates for a request naming no cap


class FakeNode:
    """Answers each API's shape with as many output tokens as the body allows; waits until
    `hold` requests are in before answering any (they run at once)."""

    def __init__(self, hold: int = 1) -> None:
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        self.hold = hold
        self.all_in = trio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        obj = json.loads(await read_body(receive, 1 << 20))
        self.bodies.append((scope["path"], obj))
        if len(self.bodies) >= self.hold:
            self.all_in.set()
        with trio.move_on_after(5):
            await self.all_in.wait()
        cap = obj.get("max_tokens", obj.get("options", {}).get("num_predict"))
        n = UNCAPPED if cap is None or cap < 0 else min(cap, UNCAPPED)
        if scope["path"].startswith("/api/"):
            answer: dict[str, Any] = {"model": "m", "done": True, "done_reason": "length",
                                      "prompt_eval_count": 7, "eval_count": n,
                                      "message": {"role": "assistant", "content": "x"},
                                      "response": "x"}
        else:
            answer = {"id": "x", "object": "chat.completion", "model": "m",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                   "text": "x", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                "total_tokens": 7 + n}}
        body = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def start(nursery: trio.Nursery, tmp: Path, fake: FakeNode, env: dict[str, str],
                engine: str = "ollama") -> tuple[Hub, str]:
    return await hub_before(nursery, tmp, fake, {"Auth__Clients__0__Name": "team",
                                                 "Auth__Clients__0__Key": "k1", **env},
                            NodeState(name="n1", slots=8, engine=engine, models=M_READY))


MSG = [{"role": "user", "content": "hello"}]


async def test_four_uncapped_chats_never_settle_past_the_token_limit(tmp_path: Path) -> None:
    fake = FakeNode(hold=4)
    async with trio.open_nursery() as nursery:
        hub, url = await start(nursery, tmp_path, fake, {"Auth__Clients__0__Tpm": "5000"})
        results: list[httpx.Response] = []

        async def one(c: httpx.AsyncClient) -> None:
            results.append(await c.post(url + "/api/chat", json={
                "model": "m", "messages": MSG, "stream": False,
                "options": {"num_predict": -1}}))

        async with httpx.AsyncClient(timeout=30, headers={"x-api-key": "k1"}) as c:
            async with trio.open_nursery() as inner:
                for _ in range(4):
                    inner.start_soon(one, c)
            st = (await c.get(url + "/api/status")).json()["tenants"]["team"]
        nursery.cancel_scope.cancel()
    assert sorted(r.status_code for r in results) == [200] * 4
    # Each was sent with a cap: the reserve (1024), what the key had left being more.
    assert [b["options"]["num_predict"] for _, b in fake.bodies] == [1024] * 4
    assert st["minute"]["tokens"] <= 5000
    assert st["served"]["output"] == 4 * 1024


async def test_the_cap_is_what_the_key_has_left_when_that_is_less(tmp_path: Path) -> None:
    fake = FakeNode()
    async with trio.open_nursery() as nursery:
        _, url = await start(nursery, tmp_path, fake, {"Auth__Clients__0__Tpm": "700"})
        async with httpx.AsyncClient(timeout=30, headers={"x-api-key": "k1"}) as c:
            r = await c.post(url + "/v1/chat/completions", json={"model": "m", "messages": MSG})
        nursery.cancel_scope.cancel()
    assert r.status_code == 200
    path, body = fake.bodies[0]
    size = len(json.dumps({"model": "m", "messages": MSG}, separators=(",", ":")))
    # (less the stream the hub asks of the engine for one answer: no prompt in it)
    sent = len(json.dumps({k: v for k, v in body.items()
                           if k not in ("stream", "stream_options")}, separators=(",", ":")))
    # What was left after the body (and room for the field written in), all sent as the cap.
    assert path == "/v1/chat/completions" and body["max_tokens"] == 700 - size - ROOM
    assert sent + body["max_tokens"] <= 700
    assert r.json()["usage"]["completion_tokens"] == 700 - size - ROOM


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": MSG}, "max_tokens"),
    ("/v1/completions", {"prompt": "once"}, "max_tokens"),
    ("/v1/responses", {"input": "hi"}, "max_tokens"),  # translated onto chat
    ("/api/generate", {"prompt": "hi", "stream": False}, "num_predict"),
    ("/api/chat", {"messages": MSG, "stream": False, "options": {"num_predict": -2,
                                                                  "temperature": 0}},
     "num_predict"),
])
async def test_each_api_gets_its_cap_written_in(tmp_path: Path, path: str, body: dict[str, Any],
                                                 field: str) -> None:
    fake = FakeNode()
    async with trio.open_nursery() as nursery:
        _, url = await start(nursery, tmp_path, fake, {"Auth__Clients__0__TokensPerDay": "9000",
                                                       "Auth__ReserveOutputTokens": "300"})
        async with httpx.AsyncClient(timeout=30, headers={"x-api-key": "k1"}) as c:
            r = await c.post(url + path, json={"model": "m", **body})
            anon = await c.post(url + path, json={"model": "m", **body},
                                headers={"x-api-key": ""})
        nursery.cancel_scope.cancel()
    assert r.status_code == 200 and anon.status_code == 200, (r.text, anon.text)
    (_, mine), (_, other) = fake.bodies
    got = mine["options"][field] if field == "num_predict" else mine[field]
    assert got == 300
    if field == "num_predict" and "options" in body:
        assert mine["options"]["temperature"] == 0
    # A key with no token limit: the body goes as the client sent it.
    assert other.get("max_tokens") is None and other.get("options", {}).get(
        "num_predict") == body.get("options", {}).get("num_predict")


def test_uncapped_is_the_reserve_or_what_is_left_and_none_without_a_token_limit() -> None:
    lim = Limiter([ClientConfig(name="t", key="k", tpm=2000),  # type: ignore[call-arg]
                   ClientConfig(name="d", key="k2", tokens_per_day=500),  # type: ignore[call-arg]
                   ClientConfig(name="r", key="k3", rpm=5)], 1024)  # type: ignore[call-arg]
    assert lim.uncapped("t", 0.0, 100) == 1024
    lim.admit("t", 0.0, 100, 1024)
    assert lim.uncapped("t", 1.0, 100) == 2000 - 1124 - 100
    lim.admit("t", 1.0, 100, 776)
    assert lim.uncapped("t", 2.0, 800) == 1  # nothing left: the admission refuses it
    assert lim.uncapped("d", 0.0, 100) == 400
    assert lim.uncapped("r", 0.0, 100) is None and lim.uncapped("nobody", 0.0, 1) is None


def test_with_cap_writes_each_apis_field_and_nothing_else() -> None:
    obj = {"model": "m", "options": {"num_predict": -1, "top_k": 3}}
    got = with_cap("/api/chat", obj, 50)
    assert got is not None and got[0]["options"] == {"num_predict": 50, "top_k": 3}
    assert obj["options"]["num_predict"] == -1  # the caller's object is untouched
    assert json.loads(got[1]) == got[0]
    assert with_cap("/v1/responses", {}, 9) == ({"max_output_tokens": 9},
                                                b'{"max_output_tokens":9}')
    assert with_cap("/v1/embeddings", {}, 9) is None
    assert with_cap("/api/generate", {"options": "x"}, 9) is None
