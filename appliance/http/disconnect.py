"""Cancel what a request waits on when its client hangs up.

Theory of operation: an ASGI server says `http.disconnect` on `receive` once the client
is gone (after the body has been read). `cancel_on_disconnect` cancels the work's scope
when the client goes and sets `Gone.gone`, so the caller can tell "finished" from
"abandoned". `finished`, when given, is asked first: a server says "disconnect" as its
last byte goes out too, and a finished response must not be interrupted then.

Two ways to notice the hang-up, the same outcome:
- Given the request's `scope` on a plain TCP connection (the listener's server puts the
  connection in `state`, appliance/server/fastio.py's DIRECT_KEY), the client's socket is
  watched by `Hangups`: one task per process, one epoll set of the sockets whose requests
  wait now, each registered for the peer's close (EPOLLRDHUP, and the always-reported
  HUP/ERR: never for readable bytes, so a pipelined request is no hang-up). A request
  pays two epoll_ctl calls instead of a nursery and a watcher task (~35 us of CPU, a
  third of the hub's own share of a short request). A socket the set cannot take (no
  epoll, a socket already watched) falls back to the watcher.
- Otherwise a watcher task beside the work waits for `http.disconnect` on `receive`.
"""

from __future__ import annotations

import select
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

from appliance.server.fastio import DIRECT_KEY, plain_socket

Receive = Callable[[], Awaitable[dict[str, Any]]]
_HUNG_UP = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLHUP", 0) | getattr(
    select, "EPOLLERR", 0)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Gone:
    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False


def client_socket(scope: dict[str, Any] | None) -> socket.socket | None:
    """The plain TCP socket of the request's client connection, or None (TLS, no server
    connection in `state`, a test's fake scope)."""
    if not scope:
        return None
    server = (scope.get("state") or {}).get(DIRECT_KEY)
    if server is None:
        return None
    sock = getattr(server, "sock", None)  # the lean server's connection (appliance/http)
    if isinstance(sock, socket.socket):
        return sock
    stream = getattr(server, "stream", None)  # hypercorn's TCPServer
    return plain_socket(stream) if stream is not None else None


class Hangups:
    """The client sockets whose requests wait now, watched for the peer's close by one
    task (started with the first `add` of a trio run, ended with the run)."""

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._calls: dict[int, Callable[[], None]] = {}

    def add(self, sock: socket.socket, fn: Callable[[], None]) -> int | None:
        """Call `fn()` (once, from the watching task) when `sock`'s peer hangs up; the
        fd to `remove`, or None when it cannot be watched here."""
        fd = sock.fileno()
        if fd < 0 or fd in self._calls:
            return None
        try:
            self._ep.register(fd, _HUNG_UP)
        except OSError:
            return None
        self._calls[fd] = fn
        return fd

    def remove(self, fd: int) -> None:
        if self._calls.pop(fd, None) is not None:
            try:
                self._ep.unregister(fd)
            except OSError:  # closed meanwhile: the kernel dropped it from the set
                pass

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


def _watcher() -> Hangups | None:
    """This trio run's Hangups (started on first use), or None where there is no epoll."""
    try:
        return _hangups.get()
    except LookupError:
        pass
    h: Hangups | None = None
    if _HUNG_UP and hasattr(select, "epoll"):
        h = Hangups()
        trio.lowlevel.spawn_system_task(h.run, name="appliance.http.disconnect.Hangups")
    _hangups.set(h)
    return h


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive, finished: Callable[[], bool] | None = None,
                               scope: dict[str, Any] | None = None) -> AsyncIterator[Gone]:
    """`async with cancel_on_disconnect(receive) as g:` -- the body is cancelled when the
    client hangs up (then `g.gone`), unless `finished()` says the answer is complete.
    `scope`: the request's, to watch its socket without a task (see above)."""
    g = Gone()
    sock = client_socket(scope)
    hangups = _watcher() if sock is not None else None
    if hangups is not None and sock is not None:
        cs = trio.CancelScope()

        def hung_up() -> None:
            if finished is not None and finished():
                return
            g.gone = True
            cs.cancel()

        fd = hangups.add(sock, hung_up)
        if fd is not None:
            try:
                with cs:
                    yield g
            finally:
                hangups.remove(fd)
            return  # (also after our own cancel: the generator must not yield again)
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            await wait_disconnect(receive)
            if finished is not None and finished():
                return
            g.gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            yield g
        finally:
            nursery.cancel_scope.cancel()
