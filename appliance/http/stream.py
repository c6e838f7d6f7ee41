"""A relayed answer and its client: the relay loop, a cut, the client's hang-up.

Relay: a server that relays (the hub from a node, the node from its engine) copies the
answer chunk by chunk with `relay_body`: one plain loop under one cancel scope for the
cost of a relayed token. That scope is the `Cut`'s (a lost node, the drain's end: it
cancels only the read in progress, never a write to the client) and carries the read
deadline lazily: "read_timeout after some read began", never moved per read; when it
fires early (the read in progress began later: the body's `waited_at`) a fresh scope
continues. Writes are our server's `send` (appliance/server/send.py), which never leaves
a write half-way when cancelled, so a cut or a deadline interrupts only a read.
`receive_within` is one read bounded the same way. A stream cut before its end gets one
error event in its own framing (`stream_error`): an SSE `data:` event (`event: error`
first for Anthropic's) or one NDJSON line, never a blank line an NDJSON reader chokes on.

Hang-up: `cancel_on_disconnect` cancels the work's scope when the client goes (then
`Gone.gone`), unless `finished()` says the answer is complete (a server says "disconnect"
as its last byte goes out too). Our server offers a `HangupWatch` as the ASGI extension
HANGUP (one epoll set per process watches the client's socket: no task per request);
elsewhere (a test's fake scope, a socket it cannot watch) a watcher task waits for
`http.disconnect` on `receive`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

from appliance.http.errors import error_body

Send = Callable[[dict[str, Any]], Awaitable[None]]


class Waitable(Protocol):
    """A trio.Event, or anything else waited on the same way (hub/fleet/nodes.py Flag)."""

    async def wait(self) -> None: ...


class Cut:
    """Why a relay must stop now (e.g. `node_lost`, `shutting_down`), and the read it
    interrupts. `trip` cancels the read in progress, and every later read; watchers
    (`watch`) run in the relay's nursery."""

    reason = ""
    _scope: trio.CancelScope | None = None  # the read in progress

    def trip(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
        if self._scope is not None:
            self._scope.cancel()

    def reading(self) -> trio.CancelScope:
        cs = trio.CancelScope()
        if self.reason:
            cs.cancel()
        self._scope = cs
        return cs

    async def watch(self, event: Waitable, reason: str) -> None:
        await event.wait()
        self.trip(reason)


def stream_error(ctype: str, api: str, code: str, msg: str, tail: bytes = b"\n\n",
                 status: int = 503) -> bytes:
    """The error event that ends a cut stream, in the stream's own framing. `tail` is the
    last bytes already sent: the event starts on a line of its own."""
    body = error_body(api, status, code, msg)
    if "event-stream" in ctype:
        if not tail or tail.endswith(b"\n\n"):
            sep = b""
        else:
            sep = b"\n" if tail.endswith(b"\n") else b"\n\n"
        event = b"event: error\n" if api == "anthropic" else b""
        return sep + event + b"data: " + body + b"\n\n"
    sep = b"" if not tail or tail.endswith(b"\n") else b"\n"
    return sep + body + b"\n"


class Relayed:
    """How a relay ended: `ended` (the source finished), else `failure` (its error text)
    or a cut (`Cut.reason`); `tail` is the last two bytes sent."""

    ended = False
    failure = ""
    tail = b""


class Body(Protocol):
    """What `relay_body` reads (client.upstream.Response, hub.api.relay.Converted)."""

    @property
    def read_timeout(self) -> float: ...

    @property
    def waited_at(self) -> float: ...  # trio time the read in progress began waiting

    async def receive(self) -> bytes: ...  # b"" at the end; safe to cancel

    async def timed_out(self) -> Exception: ...  # the error for a read that waited too long


async def relay_body(body: Body, send: Send, cut: Cut | None,
                     errors: tuple[type[BaseException], ...], tail: bytes = b"") -> Relayed:
    """Copy `body` to the client as `more_body` messages until it ends, a read raises one
    of `errors`, or `cut` trips (the caller ends the response: normally, or with
    `stream_error`); each read bounded by `body.read_timeout` (`body.timed_out()` is then
    the failure, or raised when it is not one of `errors`): the plain loop under one scope
    (see the module's docstring). `send` must be our server's (or one that, like it, never
    leaves a write half-way when cancelled)."""
    r = Relayed()
    r.tail = tail
    receive = body.receive
    deadline = trio.current_time() + body.read_timeout
    while True:
        scope = cut.reading() if cut is not None else trio.CancelScope()
        scope.deadline = deadline
        with scope:
            try:
                while True:
                    chunk = await receive()
                    if not chunk:
                        r.ended = True
                        return r
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    r.tail = chunk[-2:] if len(chunk) > 1 else (r.tail + chunk)[-2:]
            except errors as e:
                r.failure = str(e) or type(e).__name__
                return r
        if cut is not None and cut.reason:
            return r
        deadline = body.waited_at + body.read_timeout
        if trio.current_time() >= deadline:
            late = await body.timed_out()
            if isinstance(late, errors):
                r.failure = str(late)
                return r
            raise late


async def receive_within(body: Body) -> bytes:
    """`body.receive()` bounded by its read_timeout (`body.timed_out()` raised past it)."""
    try:
        with trio.fail_after(body.read_timeout):
            return await body.receive()
    except trio.TooSlowError:
        raise await body.timed_out() from None


# --- the client's hang-up ----------------------------------------------------------------

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

    def watch(self, fn: Callable[[], None]) -> Callable[[], object] | None:
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
