"""A reload moves a running listener's limits (appliance/server/limits.py `LiveLimits`), on
plain and TLS listeners alike, over real loopback sockets under trio's autojump clock: the next request -- on a connection opened before
the reload too -- gets the new head and body deadlines and the new body budget, and a
raised connection bound lets a waiting client in at once."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial

import h11
import pytest
import trio

from appliance.http.asgi import read_body
from appliance.server.limits import Limits, LiveLimits
from appliance.server.serve import serve
from tests.harness.h11io import response, until_closed


async def echo(scope, receive, send):
    body = await read_body(receive, 1 << 20)
    if scope["path"] == "/hold":
        await scope["state"]["release"].wait()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps({"n": len(body)}).encode()})


@asynccontextmanager
async def serving(live: LiveLimits, wire, release: trio.Event | None = None):
    release = release if release is not None else trio.Event()

    async def app(scope, receive, send):
        scope.setdefault("state", {})["release"] = release
        await echo(scope, receive, send)

    async with trio.open_nursery() as n:
        host, port = await n.start(partial(serve, app, "127.0.0.1:0", "fake", limits=live,
                                           **wire.serve_kwargs))
        try:
            yield host, port
        finally:
            n.cancel_scope.cancel()


def post(n: int, path: str = "/v1/x") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n\r\n".encode()
            + b"y" * n)


async def ask(stream, conn: h11.Connection, request: bytes) -> int:
    """One request on a kept-alive connection; its answer's status."""
    await stream.send_all(request)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"),
                                                              ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    status = (await response(stream, conn))[0]
    conn.start_next_cycle()
    return status


def code(raw: bytes) -> str:
    return json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"]


async def test_the_next_request_gets_the_reloaded_deadlines_and_budget(wire, autojump_clock):
    live = LiveLimits(Limits(header_read_seconds=10, body_read_seconds=30,
                             max_buffered_bytes=10_000))
    async with serving(live, wire) as (host, port):
        kept = await wire.connect(host, port)
        conn = h11.Connection(h11.CLIENT)
        assert await ask(kept, conn, post(5000)) == 200  # 5000 body bytes held: within 10 000
        assert live.set(Limits(header_read_seconds=3, body_read_seconds=5,
                               max_buffered_bytes=1000))
        assert not live.set(live.now)
        assert await ask(kept, conn, post(10)) == 200  # the connection from before stays
        t0 = trio.current_time()
        await kept.send_all(b"GET / HTTP/1.1\r\n")  # its next head: the new head deadline
        raw = await until_closed(kept)
        assert raw.startswith(b"HTTP/1.1 408") and trio.current_time() - t0 == pytest.approx(
            3, abs=0.5)

        fresh = await wire.connect(host, port)  # a new body deadline: 5 s, not 30
        await fresh.send_all(post(10)[:-7])
        t0 = trio.current_time()
        raw = await until_closed(fresh)
        assert raw.startswith(b"HTTP/1.1 408") and code(raw) == "request_timeout"
        assert trio.current_time() - t0 == pytest.approx(5, abs=0.5)

        fresh = await wire.connect(host, port)  # the new budget: 5000 bytes are too many
        await fresh.send_all(post(5000))
        raw = await until_closed(fresh)
        assert raw.startswith(b"HTTP/1.1 503") and code(raw) == "busy"


async def test_a_raised_connection_bound_lets_a_waiting_client_in(wire, autojump_clock):
    live = LiveLimits(Limits(max_connections=1))
    release = trio.Event()
    async with serving(live, wire, release) as (host, port):
        holder = await wire.connect(host, port)
        await holder.send_all(b"GET /hold HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await trio.sleep(1)
        # in the kernel's backlog (a TLS handshake waits for the accept: sent from the task)
        waiting = await wire.connect(host, port, handshake=False)
        got: list[bytes] = []

        async def read_waiting() -> None:
            await waiting.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got.append(await until_closed(waiting))

        async with trio.open_nursery() as n:
            n.start_soon(read_waiting)
            await trio.sleep(60)
            assert got == []  # the one place is taken by a request: not served
            live.set(Limits(max_connections=2))
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0.01)
            assert got[0].startswith(b"HTTP/1.1 200")
            assert not release.is_set()  # served beside the held request, not after it
            release.set()
        assert (await until_closed(holder)).startswith(b"HTTP/1.1 200")
