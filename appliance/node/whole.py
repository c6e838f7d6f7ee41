"""The engine's stream gathered into one body, for a hub that only assembles it.

Theory of operation: the hub asks every engine to stream a generation, even one its client
wants whole -- a client that leaves closes the stream, which stops the engine -- and
assembles the answer itself (hub/translate/assemble.py). Relayed event by event, each of the
~10 events of a short answer costs a chunked write here and a read, a parse and a wake-up
on the hub, for bytes the hub only gathers. A hub that will only assemble says so
(`WHOLE_HEADER`, its value the hub's read bound, Hub__UpstreamReadSeconds); `Gather` then
wraps the proxy's `send`: the head of a 200 `text/event-stream` answer is held, its body
gathered, and an answer that ends within `HOLD_SECONDS` goes out in one body with its
length -- the hub takes it with its head, in one read. A longer one goes out in pieces, what
was gathered each time a chunk comes `HOLD_SECONDS` after the last piece (a quarter of the
hub's read bound where that is less), so the hub's read deadline sees at most that much
more silence than the engine's, and past `GATHER_LIMIT` bytes at once (memory stays
bounded). Anything else (an error, another content type) passes through at once. Still the
engine's own bytes: no parsing here. Hang-up is unchanged: the gather runs inside the
proxy's disconnect watch, so a hub that leaves cancels it and the engine's stream is closed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import trio

from appliance.http.asgi import Send
from appliance.wire import WHOLE_HEADER

_HEADER = WHOLE_HEADER.encode()
# The most bytes held for one answer: the hub parses a whole answer up to 4 MiB
# (translate/usage.py's WHOLE_LIMIT); a short chat's stream is a few KiB.
GATHER_LIMIT = 4 * 1024 * 1024
# The longest a gathered piece is held: a short answer (a few dozen tokens at tens of
# tokens a second) ends within it; a long one reaches the hub once a second, not per token.
HOLD_SECONDS = 1.0


def hold_for(headers: Iterable[tuple[bytes, bytes]]) -> float | None:
    """How long the hub lets a gathered piece be held (`WHOLE_HEADER`: its read bound in
    seconds, a quarter of it at most HOLD_SECONDS); None when it did not ask, or said no
    positive finite number."""
    for k, v in headers:
        if k == _HEADER:
            if len(v) > 16:
                return None
            try:
                bound = float(v)
            except ValueError:
                return None
            if not (bound > 0 and math.isfinite(bound)):
                return None
            return min(HOLD_SECONDS, bound / 4)
    return None


class Gather:
    """`send` for the proxy: a 200 event stream held and sent in as few bodies as its
    length and `hold` allow (one for a short answer)."""

    __slots__ = ("_send", "_hold", "_start", "_gathering", "_parts", "_size", "_since")

    def __init__(self, send: Send, hold: float) -> None:
        self._send = send
        self._hold = hold
        self._start: dict[str, Any] | None = None  # the held head, until the first piece
        self._gathering = False  # a 200 event stream's body is being gathered
        self._parts: list[bytes] = []
        self._size = 0
        self._since = 0.0  # when the head came or the last piece went out (trio time)

    async def __call__(self, message: dict[str, Any]) -> None:
        if not self._gathering:
            if message["type"] == "http.response.start" and _gathered(message):
                self._start, self._gathering = message, True
                self._since = trio.current_time()
                return
            await self._send(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if body:
            self._parts.append(body)
            self._size += len(body)
        if more:
            if self._size <= GATHER_LIMIT and trio.current_time() - self._since < self._hold:
                return
            if not self._size:
                return
        # The end, the bound or the hold: the head (the first time) and what is held.
        held, self._parts, self._size = b"".join(self._parts), [], 0
        start, self._start = self._start, None
        self._gathering = more
        if start is not None:
            await self._send(start)
        self._since = trio.current_time()
        await self._send({"type": "http.response.body", "body": held, "more_body": more})


def _gathered(start: dict[str, Any]) -> bool:
    if start.get("status") != 200:
        return False
    for k, v in start.get("headers") or ():
        if k == b"content-type":
            return bytes(v).startswith(b"text/event-stream")
    return False
