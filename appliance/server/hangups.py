"""Watching client connections for the peer's hang-up without a task per request.

Theory of operation: a request that waits (queued, loading, relaying) must stop when its
client hangs up (appliance/http/disconnect.py). A watcher task per request costs a nursery
and a task (~35 us of CPU, a third of the hub's own share of a short request); instead
one task per process holds one epoll set of the sockets whose requests wait now, each
registered for the peer's close (EPOLLRDHUP, and the always-reported HUP/ERR: never for
readable bytes, so a pipelined request is no hang-up). A request pays two epoll_ctl
calls. The connection (appliance/server/connection.py) offers this to apps as its
`HangupWatch` (`watch`, on its receive side: appliance/server/receive.py); a socket the
set cannot take (no epoll, one already watched) gets None, and the app falls back to a
watcher task.
"""

from __future__ import annotations

import select
from collections.abc import Callable

import trio

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


def hangups() -> Hangups | None:
    """This trio run's Hangups (started on first use), or None where there is no epoll."""
    try:
        return _hangups.get()
    except LookupError:
        pass
    h: Hangups | None = None
    if _HUNG_UP and hasattr(select, "epoll"):
        h = Hangups()
        trio.lowlevel.spawn_system_task(h.run, name="appliance.server.hangups.Hangups")
    _hangups.set(h)
    return h


def watch_hangup(fd: int, fn: Callable[[], None]) -> Callable[[], None] | None:
    """`fn()` once when the peer of socket `fd` hangs up; the function that stops
    watching, or None when it cannot be watched."""
    h = hangups()
    if h is None or not h.add(fd, fn):
        return None
    return lambda: h.remove(fd)
