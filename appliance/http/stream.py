"""Relaying a stream, and ending one early, cleanly.

Theory of operation: a server that relays (the hub from a node, the node from its engine)
copies the answer chunk by chunk with `relay_body`. Something outside the copy may
decide it must stop -- the node was declared lost, the drain ran out: `Cut` cancels only
the read in progress, never a write to the client (a write cut half-way leaves the
client's connection in an unknown state). A stream that ends before its end gets one
error event, in the stream's own framing (`stream_error`): an SSE `data:` event
(`event: error` first for Anthropic's), or one valid NDJSON line -- which the `ollama`
client raises as ResponseError -- never a blank line an NDJSON reader would choke on.

`relay_body` copies a body passed through unchanged (appliance/client/upstream.py's
Response, or the hub's translation of one), written as one plain loop for the cost of a
relayed token (issue 15): one cancel scope for the whole relay, not one per read -- it is
the Cut's scope, and it also carries the read deadline, lazily: its deadline is
"read_timeout after some read began", never moved per read; when it fires, a read that
began less than read_timeout ago (the body's `waited_at`) means it fired early, and a
fresh scope continues with the deadline of the read in progress. So the deadline is exact
and costs nothing per event. Its writes are the ASGI `send` of our server
(appliance/server/send.py), the one path every response byte takes, called inside that
scope: that server's `send` never leaves a write half-way when cancelled (its waits are
shielded once bytes go out), so a cut or a deadline interrupts only a read, where nothing
is lost. `receive_within` is one read of such a body bounded the same way (an answer's
first read, a whole body read by `chunks`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
