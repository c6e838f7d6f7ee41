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

The decisions (`Slots`, `Shed`) are plain; the rest waits and accepts.
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
from appliance.server.connection import Conn, Shared, Slot
from appliance.server.limits import Budget, Limits, LiveLimits

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

    def one(self, live: dict[Slot, None], limit: int) -> bool:
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


class Slots:
    """Open connections against `max_connections`, a bound a reload may move: a raised one
    lets waiting accepts through at once, a lowered one closes nothing."""

    def __init__(self, live: LiveLimits) -> None:
        self.live = live
        self.held = 0
        self._lot = trio.lowlevel.ParkingLot()

    def full(self) -> bool:
        return self.held >= self.live.now.max_connections

    async def acquire(self) -> None:
        while self.full():
            await self._lot.park()
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        self._lot.unpark()

    def wake(self) -> None:
        self._lot.unpark_all()


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
        nodelay(sock)
        return sock


async def serve_sockets(app: Callable[..., Awaitable[None]], sockets: list[socket.socket],
                        tls: ssl.SSLContext | None, live: LiveLimits, settings: Settings, *,
                        shutdown_trigger: Callable[[], Awaitable[Any]],
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on the listening `sockets` until `shutdown_trigger` returns, then drain
    (see the module's docstring)."""
    for lsock in sockets:
        lsock.setblocking(False)
    budget = Budget(live.now.max_buffered_bytes)
    shared = Shared(app, live, budget, keep_alive=settings.keep_alive,
                    max_head=settings.max_head, max_requests=settings.max_requests)
    slots = Slots(live)
    open_slots: dict[Slot, None] = {}  # open connections, oldest first
    transports: dict[Slot, Transport] = {}
    shed = Shed()

    def follow(new: Limits) -> None:  # a reload: what is not read per connection or request
        budget.limit = new.max_buffered_bytes
        slots.wake()

    async def connection(sock: socket.socket) -> None:
        slot = Slot()
        open_slots[slot] = None
        stall, rate = live.now.write_stall_seconds, live.now.min_read_bytes_per_second
        transport = (TlsTransport(sock, tls, server_side=True, stall=stall, min_rate=rate)
                     if tls is not None else Transport(sock, stall, rate))
        transports[slot] = transport
        try:
            with slot.cancel:
                await Conn(transport, shared, slot).run()
        finally:
            open_slots.pop(slot, None)
            transports.pop(slot, None)
            slots.release()
            with trio.move_on_after(CLOSE_SECONDS, shield=True):
                await transport.aclose()

    async def accept_loop(lsock: socket.socket, handlers: trio.Nursery) -> None:
        while True:
            sock = await _accept(lsock)
            try:
                if slots.full():
                    shed.one(open_slots, live.now.max_connections)
                await slots.acquire()
            except BaseException:
                sock.close()
                raise
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
                for s in list(open_slots):
                    if not s.in_request:
                        s.cancel.cancel()
                handlers.cancel_scope.deadline = trio.current_time() + settings.drain
                # Writes waiting on clients that do not read are shielded from that cancel:
                # they end at the same deadline, so the process exits within the drain.
                for t in list(transports.values()):
                    t.abort_by(handlers.cancel_scope.deadline)
