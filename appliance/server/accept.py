"""A listener's accept loop: the connection bound, shedding, TLS or not, and the drain.

Theory of operation: `serve_sockets` accepts on listening sockets it was given (plain,
or TLS with an `ssl.SSLContext`) and runs one appliance/server/connection.py `Conn` per
connection -- the same code for both kinds: a TLS connection is a `TlsTransport`
(appliance/net/transport.py), its handshake part of the head deadline. It owns:

- The connection bound: at most `max_connections` open. At the bound, a new client takes
  the place of the oldest connection that serves no request (idle, or still trickling its
  head or handshake: `Shed`); when every one is serving, the next waits in the kernel's
  backlog (no fd here).
- The drain: once `shutdown_trigger` returns, the listening sockets close, idle
  connections close at once, and those serving a request have `drain` seconds to finish.
- A reload (`LiveLimits.set`): a raised bound lets waiting accepts through at once, a
  lowered one closes nothing; the body budget follows.

The decision (`Shed`) is plain; the rest waits and accepts.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from appliance.net.transport import TlsTransport, Transport, nodelay
from appliance.server.connection import Conn, Shared
from appliance.server.limits import Limits, LiveLimits
from appliance.server.receive import Budget
from appliance.server.send import hangups

log = logging.getLogger("appliance.server.listener")

# errnos of accept() that mean "out of fds/memory now", as trio's serve_listeners lists them.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# errnos of accept() about the one connection that failed (trio ignores these too).
_ACCEPT_SKIP = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                errno.ENETUNREACH}
# A connection whose handler does not end within the drain is cut; its close is this short.
CLOSE_SECONDS = 1.0


@dataclass(frozen=True)
class Settings:
    """What a listener is, beside its live limits."""

    keep_alive: float = 75.0  # idle seconds between requests (hypercorn's default too)
    max_head: int = 16 * 1024  # a request head's bytes (hypercorn's h11_max_incomplete_size)
    max_requests: int = 1000  # per connection, then `connection: close`
    drain: float = 5.0  # seconds for requests in flight once the listener stops


class Shed:
    """At `max_connections`, a new client takes the place of the oldest connection that is
    not serving a request (idle, or still sending its head): otherwise clients that only
    trickle head bytes would make every new one wait out their head deadlines."""

    # One warning per minute at most while the listener sheds.
    LOG_EVERY = 60.0

    def __init__(self) -> None:
        self.count = 0
        self._logged = -math.inf

    def one(self, live: dict[Conn, None], limit: int) -> bool:
        for s in live:
            if not s.in_request:
                del live[s]
                s.cancel.cancel()
                self.count += 1
                now = trio.current_time()
                if now - self._logged >= self.LOG_EVERY:
                    self._logged = now
                    log.warning("%d connections open (the bound): closing the oldest that serve "
                                "no request to take new ones (%d so far)", limit, self.count)
                return True
        return False


async def _accept(lsock: socket.socket) -> socket.socket:
    """The next connection on a non-blocking listening socket (trio's accept rules)."""
    while True:
        await trio.lowlevel.wait_readable(lsock)
        try:
            sock, _ = lsock.accept()
        except BlockingIOError:
            continue
        except OSError as e:
            if e.errno in _ACCEPT_SKIP:
                continue
            if e.errno not in _ACCEPT_CAPACITY:
                raise
            log.error("accept failed (%s); pausing 100 ms", errno.errorcode.get(e.errno, e.errno))
            await trio.sleep(0.1)
            continue
        return sock  # (TCP_NODELAY: the listening socket's, inherited on Linux)


async def serve_sockets(app: Callable[..., Awaitable[None]], sockets: list[socket.socket],
                        tls: ssl.SSLContext | None, live: LiveLimits, settings: Settings, *,
                        shutdown_trigger: Callable[[], Awaitable[Any]],
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on the listening `sockets` until `shutdown_trigger` returns, then drain
    (see the module's docstring)."""
    for lsock in sockets:
        lsock.setblocking(False)
        nodelay(lsock)  # small writes go out at once: a token is a write (accepted: inherited)
    budget = Budget(live.now.max_buffered_bytes)
    shared = Shared(app, live, budget, keep_alive=settings.keep_alive,
                    max_head=settings.max_head, max_requests=settings.max_requests,
                    hangups=hangups())
    # The connection bound, a bound a reload may move: a raised one lets waiting accepts
    # through at once (`lot`), a lowered one closes nothing.
    held = 0
    lot = trio.lowlevel.ParkingLot()
    conns: dict[Conn, None] = {}  # open connections, oldest first
    shed = Shed()

    def follow(new: Limits) -> None:  # a reload: what is not read per connection or request
        budget.limit = new.max_buffered_bytes
        lot.unpark_all()

    async def connection(sock: socket.socket) -> None:
        nonlocal held
        stall, rate = live.now.write_stall_seconds, live.now.min_read_bytes_per_second
        transport = (TlsTransport(sock, tls, server_side=True, stall=stall, min_rate=rate)
                     if tls is not None else Transport(sock, stall, rate))
        conn = Conn(transport, shared)
        conns[conn] = None
        try:
            with conn.cancel:
                await conn.run()
        finally:
            conns.pop(conn, None)
            held -= 1
            lot.unpark()
            with trio.move_on_after(CLOSE_SECONDS, shield=True):
                await transport.aclose()

    async def accept_loop(lsock: socket.socket, handlers: trio.Nursery) -> None:
        nonlocal held
        while True:
            sock = await _accept(lsock)
            try:
                if held >= live.now.max_connections:
                    shed.one(conns, live.now.max_connections)
                    while held >= live.now.max_connections:
                        await lot.park()
            except BaseException:
                sock.close()
                raise
            held += 1
            handlers.start_soon(connection, sock)

    with live.following(follow):
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as acceptors:
                    for lsock in sockets:
                        acceptors.start_soon(accept_loop, lsock, handlers)
                    task_status.started()
                    await shutdown_trigger()
                    acceptors.cancel_scope.cancel()
            finally:
                for lsock in sockets:
                    lsock.close()
                shared.terminating = True  # idle connections close now, busy ones after
                for c in list(conns):
                    if not c.in_request:
                        c.cancel.cancel()
                handlers.cancel_scope.deadline = trio.current_time() + settings.drain
                # Writes waiting on clients that do not read are shielded from that cancel:
                # they end at the same deadline, so the process exits within the drain.
                for c in list(conns):
                    c.transport.abort_by(handlers.cancel_scope.deadline)
