"""The send side of one HTTP/1.1 connection (appliance/server/connection.py): ASGI response
messages to bytes on the client's transport -- the one path every response byte takes.

Owns the writing: `http.response.start` is only noted; the head is decided with the first
body message (appliance/h1/state.py `response_head`: one write of head + body for a small
answer, chunked or close-delimited for a stream), and the framing, what a sized answer
still owes and `sent_end` are the table's. Writes go straight to the transport
(appliance/net/transport.py), under the connection's lock. `send` never leaves a write
half-way: its only cancellable wait comes before the message's first byte (the lock), so
a relay may call it inside a scope a `Cut` or a read deadline cancels
(appliance/http/stream.py). A failed write makes the server side ERROR: later writes are
dropped and the receive side says `http.disconnect` (`answered`).

It is also the app's `HangupWatch` (the ASGI extension HANGUP): what was delivered
(`delivered`, `stalled`, `drained`), and the client's hang-up (`watch`) without a task per
request (a watcher task cost ~35 us of CPU, a third of the hub's share of a short
request): one task per process holds one epoll set (`Hangups`, found once per listener)
of the sockets whose requests wait now, registered for the peer's close (EPOLLRDHUP,
HUP, ERR; never readable bytes: a pipelined request is no hang-up). A failed write tells
the watcher too; a socket the set cannot take gets None (the app then runs a task).
"""

from __future__ import annotations

import select
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from appliance.h1.state import (
    BROKEN,
    CHUNKED,
    ERROR,
    NO_BODY,
    RESPONSE_END,
    SEND_BODY,
    SIZED,
    UNTIL_CLOSE,
    Cycle,
    response_head,
)
from appliance.net.transport import Transport, WriteStalled

_HUNG_UP = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0) | getattr(
    select, "EPOLLERR", 0)


class Hangups:
    """The client sockets whose requests wait now, watched for the peer's close by one
    task (started with the first `add` of a trio run, ended with the run)."""

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._calls: dict[int, Callable[[], None]] = {}

    def add(self, fd: int, fn: Callable[[], None]) -> bool:
        """Call `fn()` (once, from the watching task) when `fd`'s peer hangs up; False
        when it cannot be watched here."""
        if fd < 0 or fd in self._calls:
            return False
        try:
            self._ep.register(fd, _HUNG_UP)
        except OSError:
            return False
        self._calls[fd] = fn
        return True

    def remove(self, fd: int) -> Callable[[], None] | None:
        """Stop watching `fd`; the function it would have called (None: not watched)."""
        fn = self._calls.pop(fd, None)
        if fn is not None:
            try:
                self._ep.unregister(fd)
            except OSError:  # closed meanwhile: the kernel dropped it from the set
                pass
        return fn

    def watching(self) -> int:
        return len(self._calls)

    def fire(self) -> None:
        """Call the function of every socket hung up now (the task's one step)."""
        for fd, _ in self._ep.poll(0):
            fn = self._calls.pop(fd, None)
            try:
                self._ep.unregister(fd)
            except OSError:
                pass
            if fn is not None:
                fn()

    async def run(self) -> None:
        try:
            while True:
                await trio.lowlevel.wait_readable(self._ep)
                self.fire()
        finally:
            self._ep.close()


_hangups: trio.lowlevel.RunVar[Hangups | None] = trio.lowlevel.RunVar("appliance_hangups")


def hangups() -> Hangups | None:
    """This trio run's Hangups (started on first use), or None where there is no epoll."""
    try:
        return _hangups.get()
    except LookupError:
        pass
    h: Hangups | None = None
    if _HUNG_UP and hasattr(select, "epoll"):
        h = Hangups()
        trio.lowlevel.spawn_system_task(h.run, name="appliance.server.send.Hangups")
    _hangups.set(h)
    return h


class Sender:
    """One connection's response side; `new_response` before each request. The connection
    composes it with its receive side (appliance/server/receive.py): they share the
    connection's table (`cycle`); `closing()` says whether the connection ends after this
    answer, `answered()` is told when the answer ended or the client is gone."""

    def __init__(self, transport: Transport, cycle: Cycle | None = None,
                 closing: Callable[[], bool] | None = None,
                 answered: Callable[[], None] | None = None,
                 hangups: Hangups | None = None) -> None:
        self.transport = transport
        self.cycle = cycle if cycle is not None else Cycle()
        self.closing = closing or _never
        self.answered = answered or _nothing
        self.hangups = hangups  # the listener's (`hangups()`, looked up once): None, no watch
        self.lock = trio.Lock()
        self.stalled = False  # ... because the client read nothing for WriteStallSeconds
        self._drained = False  # ... or because the drain ended (the listener stops)
        self._watched = -1  # the fd a HangupWatch watcher waits on (`watch`)
        self.new_response("GET", "1.1")

    def new_response(self, method: str, version: str) -> None:
        """The request's method and version (the table's facts start afresh per cycle)."""
        self.method = method
        self.version = version
        self.started = False
        self.status = 0
        self.head_headers: list[tuple[bytes, bytes]] = []
        self.pending = b""  # the response head, not written yet

    @property
    def drained(self) -> bool:
        """The listener's drain ended this connection (a write, or the wait for one to
        leave, was cut there), or its end has come while the answer still runs."""
        return self._drained or self.transport.aborted

    async def send(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        cycle = self.cycle
        if kind == "http.response.body":
            if not self.started:
                raise RuntimeError("http.response.body before http.response.start")
            if cycle.sent_end:
                return
            more = msg.get("more_body", False)
            body = msg.get("body", b"")
            framing = cycle.framing
            if not framing:  # the first body message: the head is decided now
                f = response_head(self.status, self.head_headers, method=self.method,
                                  version=self.version, body=body, more=more,
                                  close=self.closing())
                self.pending = f.head
                cycle.respond(f.framing, f.length, f.close)
                framing = f.framing
            if framing == CHUNKED:
                if body:
                    data = b"%x\r\n%b\r\n" % (len(body), body)
                    if not more:
                        data += b"0\r\n\r\n"
                else:
                    data = b"" if more else b"0\r\n\r\n"
            elif framing == NO_BODY:
                data = b""
            else:
                data = body
                if framing == SIZED:
                    if len(body) > cycle.owed:
                        data = body[:cycle.owed]
                        cycle.close()  # the app wrote more than it said: cut
                    cycle.owed -= len(data)
                    if not more and cycle.owed:
                        cycle.close()  # ... or less
            if not more:
                cycle.sent_end = True
            if self.pending:
                data = self.pending + data
                self.pending = b""
            if data:
                await self.write(data)
            if not more:
                if cycle.ours == SEND_BODY:  # (not ERROR: the write went out)
                    cycle.server(RESPONSE_END)
                self.answered()
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("the response has already started")
            self.started = True
            self.status = int(msg["status"])
            self.head_headers = msg.get("headers") or []
        # other messages (trailers, push, early hints) mean nothing on HTTP/1.1 here

    async def delivered(self) -> bool:
        """Before a stream's last bytes (http/stream.py's HangupWatch): the socket
        buffers may hold the whole answer for a client that reads nothing. Waits (by the
        write stall's and the read rate's rules) until what was written has left; if it
        never does, the client is too slow: the connection ends as for a stalled write
        (False) -- or the drain ended first (False, `drained`)."""
        if self.cycle.ours == ERROR or self.cycle.framing not in (CHUNKED, UNTIL_CLOSE):
            return not (self.stalled or self.drained)
        if await self.transport.wait_sent():
            return True
        if self.transport.aborted:
            self._drained = True
        else:
            self.stalled = True
        self.abandon()
        return False

    def watch(self, fn: Callable[[], None]) -> Callable[[], object] | None:
        """HangupWatch: `fn()` once when the client hangs up -- or when a write to it fails
        (it stopped reading, or the connection broke); the function that stops watching."""
        h, fd = self.hangups, self.transport.sock.fileno()
        if h is None or not h.add(fd, fn):
            return None
        self._watched = fd
        return partial(h.remove, fd)  # (the socket stays open until the app returns)

    def abandon(self) -> None:
        """The answer is given up (a write failed, or was not worth waiting for): later
        writes are dropped and the receive side says `http.disconnect`."""
        if self.cycle.ours != ERROR:
            self.cycle.server(BROKEN)
        fd, h = self._watched, self.hangups
        if fd >= 0 and h is not None:  # a watcher waits on the socket alone: tell it
            self._watched = -1
            fn = h.remove(fd)
            if fn is not None:
                fn()
        self.answered()

    async def write(self, data: bytes, shield: bool = True) -> None:
        """All of `data`, waiting only while the transport's buffer is full -- shielded
        unless told otherwise: a write cut half-way leaves the client's connection unknown."""
        if self.cycle.ours == ERROR:  # a write failed or was given up: dropped
            return
        lock = self.lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await self.transport.send_all(data, shield)
        except OSError as e:
            if isinstance(e, WriteStalled):
                self._drained, self.stalled = e.drained, not e.drained
            self.abandon()  # receive() says http.disconnect now
        finally:
            lock.release()


def _never() -> bool:
    return False


def _nothing() -> None:
    pass
