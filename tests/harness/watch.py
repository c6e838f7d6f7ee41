"""The hub's supervisor of one node (appliance/hub/fleet/supervisor.py) in-process, on trio's
virtual clock: its `Pool` connects over a socket pair to a tiny HTTP/1.1 responder that
answers with a test's handler (an httpx.Request in, an httpx.Response out, its body streamed
chunked as the handler's stream yields it). A handler that raises, or a body that raises,
is a node that closes the connection there. A socket pair's bytes are in its peer's buffer
when `send` returns, so the autojump clock never jumps past an answer on its way."""

from __future__ import annotations

import inspect
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import h11
import httpx
import trio

from appliance.client.upstream import Pool
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.fleet.supervisor import supervise
from tests.harness.h11io import request

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]


async def _respond(handler: Handler, host: str, port: int, sock: socket.socket) -> None:
    """Answer one request on `sock` with `handler`, then close (no keep-alive)."""
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    conn = h11.Connection(h11.SERVER)
    async with stream:
        asked = await request(stream, conn)
        if asked is None:
            return
        url = f"http://{host}:{port}{asked.target.decode('latin-1')}"
        try:
            got = handler(httpx.Request(asked.method.decode(), url, headers=asked.headers))
            response = await got if inspect.isawaitable(got) else got
            headers = [(k, v) for k, v in response.headers.raw
                       if k.lower() not in (b"content-length", b"transfer-encoding")]
            await stream.send_all(conn.send(h11.Response(  # chunked: h11 frames it
                status_code=response.status_code, headers=[*headers, (b"connection", b"close")])))
            async for chunk in response.stream:  # type: ignore[union-attr]
                if chunk:
                    await stream.send_all(conn.send(h11.Data(data=chunk)))
            await stream.send_all(conn.send(h11.EndOfMessage()))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the hub hung up
        except Exception:
            pass  # the node breaks off: the connection closes here


def answering(handler: Handler, nursery: trio.Nursery) -> Pool:
    """A Pool whose every connection is answered by `handler` (tasks in `nursery`)."""

    async def open_socket(host: str, port: int) -> socket.socket:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        nursery.start_soon(_respond, handler, host, port, theirs)
        return ours

    return Pool(open_socket=open_socket)


@dataclass
class Supervised:
    reg: Registry
    h: NodeHandle
    # What the supervisor said: (event, virtual seconds since the block began, reason).
    events: list[tuple[str, float, str]] = field(default_factory=list)


@asynccontextmanager
async def supervising(handler: Handler, *, name: str = "a", static: bool = True,
                      connected: bool = False,
                      backoff_max: float = 30.0) -> AsyncIterator[Supervised]:
    """Node `name` (at http://NAME:1, heartbeat 2 s) supervised while the block runs."""
    reg = Registry()
    h, _ = reg.upsert(name, f"http://{name}:1", static=static)
    h.connected = connected
    s = Supervised(reg, h)
    start = trio.current_time()

    def said(kind: str, node: NodeHandle, reason: str) -> None:
        s.events.append((kind, trio.current_time() - start, reason))

    async with trio.open_nursery() as nursery:
        pool = answering(handler, nursery)
        nursery.start_soon(partial(supervise, pool, h, reg, heartbeat=2.0,
                                   backoff_max=backoff_max, on_event=said))
        yield s
        nursery.cancel_scope.cancel()
