"""Priority__Preempt, in-process: an essential request that finds no place takes one from a
background request with no first byte (503 `preempted`, its engine work cancelled); a
started stream is never cut."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import httpx
import trio
import trio.testing

from appliance.http.asgi import Receive, Scope, Send, read_body
from appliance.http.stream import wait_disconnect
from appliance.hub.run import Hub
from appliance.wire import NodeState
from tests.harness.engine_hub import M_READY, hub_before
from tests.harness.fleet import chat_body


class Node:
    """Background requests ("bg" in the body) are held: before their first byte
    (`first_byte=False`) or after it; anything else is answered at once."""

    def __init__(self, first_byte: bool) -> None:
        self.first_byte = first_byte
        self.seen: list[str] = []
        self.release = trio.Event()
        self.cancelled = trio.Event()
        self.arrived = trio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = json.loads(await read_body(receive, 1 << 20))
        who = body["messages"][0]["content"]
        self.seen.append(who)
        if who != "bg":
            await self._answer(send, who)
            return
        self.arrived.set()
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                await wait_disconnect(receive)
                self.cancelled.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            if self.first_byte:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                await send({"type": "http.response.body", "body": b"data: bg-0\n\n",
                            "more_body": True})
            await self.release.wait()
            if not self.first_byte:
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            nursery.cancel_scope.cancel()

    async def _answer(self, send: Send, who: str) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": f"data: {who}\n\ndata: [DONE]\n\n".encode()})


async def start(nursery: trio.Nursery, node: Node, preempt: bool = True) -> tuple[Hub, str]:
    return await hub_before(nursery, None, node, {
        "Priority__Enabled": "true", "Priority__Preempt": str(preempt).lower(),
        "Priority__ReserveSlots": "0",
        "Auth__Clients__0__Name": "ops", "Auth__Clients__0__Key": "ke",
        "Auth__Clients__0__Priority": "essential",
        "Auth__Clients__1__Name": "batch", "Auth__Clients__1__Key": "kb",
        "Auth__Clients__1__Priority": "background"},
        NodeState(name="n1", max_concurrency=1, slots=1, models=M_READY))


KEYS = {"bg": "kb", "ess": "ke"}  # background, essential


async def post(c: httpx.AsyncClient, url: str, got: dict[str, httpx.Response], who: str) -> None:
    """One streamed chat as `who` ("bg" or "ess"), its whole answer kept in `got[who]`."""
    got[who] = await c.post(url + "/v1/chat/completions", json=chat_body("m", who, stream=True),
                            headers={"x-api-key": KEYS[who]})


async def until(cond: Callable[[], object]) -> None:
    while not cond():
        await trio.sleep(0.01)  # virtual


@dataclass
class Scene:
    hub: Hub
    nursery: trio.Nursery
    ask: Callable[[str], Awaitable[None]]  # ask("ess"): post() as essential
    got: dict[str, httpx.Response]


@asynccontextmanager
async def background_arrived(node: Node, preempt: bool = True) -> AsyncIterator[Scene]:
    """A hub in front of `node` (one place), and a background request arrived there."""
    got: dict[str, httpx.Response] = {}
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            hub, url = await start(nursery, node, preempt)
            async with httpx.AsyncClient(timeout=15) as c:
                nursery.start_soon(post, c, url, got, "bg")
                await node.arrived.wait()
                yield Scene(hub, nursery, partial(post, c, url, got), got)
            nursery.cancel_scope.cancel()


async def essential_behind_background(node: Node, preempt: bool = True
                                      ) -> tuple[Hub, dict[str, httpx.Response], bool]:
    """An essential request comes and waits behind the background one; then the background
    one is released. (The hub, both answers, whether the background one's engine work was
    cancelled while the essential one waited.)"""
    async with background_arrived(node, preempt) as s:
        s.nursery.start_soon(s.ask, "ess")
        await until(lambda: s.hub.admission.core.classes["essential"].waiting)
        cancelled = node.cancelled.is_set()
        node.release.set()
        await until(lambda: len(s.got) == 2)
    return s.hub, s.got, cancelled


async def test_essential_takes_the_place_of_background_before_its_first_byte(autojump_clock: trio.testing.MockClock) -> None:
    node = Node(first_byte=False)
    async with background_arrived(node) as s:
        await s.ask("ess")
        await node.cancelled.wait()  # the engine's work was cancelled
        await until(lambda: "bg" in s.got)
    got = s.got
    assert got["ess"].status_code == 200 and "data: ess" in got["ess"].text
    bg = got["bg"]
    assert bg.status_code == 503 and bg.json()["error"]["code"] == "preempted"
    assert bg.headers["retry-after"] == "5"
    assert node.seen == ["bg", "ess"]
    assert s.hub.admission.status_block()["preempted"] == 1  # type: ignore[index]


async def test_a_started_stream_is_never_cut(autojump_clock: trio.testing.MockClock) -> None:
    hub, got, cancelled = await essential_behind_background(Node(first_byte=True))
    assert not cancelled
    assert got["bg"].status_code == 200 and got["bg"].text.endswith("data: [DONE]\n\n")
    assert got["ess"].status_code == 200
    assert hub.admission.status_block()["preempted"] == 0  # type: ignore[index]


async def test_a_preempt_after_the_first_byte_cuts_nothing(
        autojump_clock: trio.testing.MockClock) -> None:
    """Whoever asks (a race with the victim choice), the relay cuts only before the first
    byte: the request's own flag set mid-stream leaves the stream whole."""
    node = Node(first_byte=True)
    async with background_arrived(node) as s:
        await until(lambda: s.hub.admission.victims.holding("m"))
        [req] = s.hub.admission.victims.holding("m")
        await until(req.first_byte)
        req.preempt()
        await trio.sleep(0.1)  # virtual
        node.release.set()
        await until(lambda: "bg" in s.got)
    assert s.got["bg"].status_code == 200 and s.got["bg"].text.endswith("data: [DONE]\n\n")
    assert not node.cancelled.is_set()


async def test_off_by_default_background_keeps_its_place(autojump_clock: trio.testing.MockClock) -> None:
    hub, got, cancelled = await essential_behind_background(Node(first_byte=False), preempt=False)
    assert not cancelled
    assert got["bg"].status_code == 200 and got["ess"].status_code == 200
    assert "preempted" not in (hub.admission.status_block() or {})


# --- the rule, without sockets (hub/decide/preempt.py) ---------------------------------------

class Req:
    def __init__(self, started: bool = False) -> None:
        self.started, self.preempted_ = started, False

    def first_byte(self) -> bool:
        return self.started

    def preempt(self) -> None:
        self.preempted_ = True


def test_the_newest_without_a_first_byte_is_preempted_once() -> None:
    from appliance.hub.decide.preempt import Victims

    v = Victims()
    old, started, new = Req(), Req(started=True), Req(started=True)
    for r in (old, started, new):
        v.hold("m", r)
    assert v.preempt_one("other") is None
    assert v.preempt_one("m") is old  # the newer two have their first byte
    assert old.preempted_ and not started.preempted_ and not new.preempted_
    assert v.preempt_one("m") is None  # nobody left who has no first byte
    v.release("m", started)
    v.release("m", new)
    assert v.held("m") == 0 and v.preempted == 1
