"""Cancel what a request waits on when its client hangs up.

Theory of operation: an ASGI server says `http.disconnect` on `receive` once the client
is gone (after the body has been read). `cancel_on_disconnect` cancels the work's scope
when the client goes and sets `Gone.gone`, so the caller can tell "finished" from
"abandoned". `finished`, when given, is asked first: a server says "disconnect" as its
last byte goes out too, and a finished response must not be interrupted then.

Two ways to notice the hang-up, the same outcome:
- The server offers a `HangupWatch` as the ASGI extension `HANGUP` in the request's
  scope (the connection's send side, appliance/server/send.py: one epoll set per process
  watches the client's socket): no task per request.
- Otherwise (no such server, a test's fake scope, a socket it cannot watch) a watcher
  task beside the work waits for `http.disconnect` on `receive`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

Receive = Callable[[], Awaitable[dict[str, Any]]]

# The ASGI extension (scope["extensions"]) under which a server offers its HangupWatch.
HANGUP = "appliance.hangup"


class HangupWatch(Protocol):
    """A server's word that it can tell when this request's client hangs up."""

    # The client stopped reading: a write made no progress for WriteStallSeconds and the
    # connection was ended (audited `client_too_slow`, not a clean answer).
    stalled: bool
    @property
    def drained(self) -> bool:
        """The listener's drain ended before the answer reached the client: the connection
        was ended there (audited as the drain's cut, `shutting_down`)."""
        ...

    async def delivered(self) -> bool:
        """Before a stream's last bytes: wait (bounded) until what was written has left;
        False when the client never took it (it is stalled and hung up, or the drain
        ended first: `drained`)."""
        ...

    def watch(self, fn: Callable[[], None]) -> Callable[[], None] | None:
        """Call `fn()` once when the client hangs up; returns the function that stops
        watching, or None when this connection cannot be watched so."""
        ...


def hangup_watch(scope: dict[str, Any] | None) -> HangupWatch | None:
    """The server's HangupWatch for this request, or None."""
    if not scope:
        return None
    watch: HangupWatch | None = (scope.get("extensions") or {}).get(HANGUP)
    return watch


async def delivered(scope: dict[str, Any] | None) -> bool:
    """Wait until this request's stream so far has reached its client (a server that can
    tell; else at once): False when it never did (the client stopped reading, and was hung
    up: `stalled`)."""
    watch: HangupWatch | None = (scope.get("extensions") or {}).get(HANGUP) if scope else None
    return True if watch is None else await watch.delivered()


def stalled(scope: dict[str, Any] | None) -> bool:
    """Did this request's connection end because its client stopped reading?"""
    watch = hangup_watch(scope)
    return watch is not None and watch.stalled


def drained(scope: dict[str, Any] | None) -> bool:
    """Did this request's connection end because the listener's drain ended?"""
    watch = hangup_watch(scope)
    return watch is not None and watch.drained


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Gone:
    """Whether the client hung up (set once, by the watch)."""

    gone = False


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive, finished: Callable[[], bool] | None = None,
                               scope: dict[str, Any] | None = None) -> AsyncIterator[Gone]:
    """`async with cancel_on_disconnect(receive) as g:` -- the body is cancelled when the
    client hangs up (then `g.gone`), unless `finished()` says the answer is complete.
    `scope`: the request's, to watch its socket without a task (see above)."""
    g = Gone()
    server: HangupWatch | None = (scope.get("extensions") or {}).get(HANGUP) if scope else None
    if server is not None:
        cs = trio.CancelScope()

        def hung_up() -> None:
            if finished is not None and finished():
                return
            g.gone = True
            cs.cancel()

        stop = server.watch(hung_up)
        if stop is not None:
            try:
                with cs:
                    yield g
            finally:
                stop()
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
