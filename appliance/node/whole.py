"""The engine's stream gathered into one body, for a hub that only assembles it.

Theory of operation: the hub asks every engine to stream a generation, even one its client
wants whole -- a client that leaves closes the stream, which stops the engine -- and
assembles the answer itself (hub/translate/assemble.py). Relayed event by event, each of the
~10 events of a short answer costs a chunked write here and a read, a parse and a wake-up
on the hub, for bytes the hub only gathers. A hub that will only assemble says so
(`WHOLE_HEADER`); `Gather` then wraps the proxy's `send`: the head of a 200
`text/event-stream` answer is held, its body gathered, and the whole stream goes out in one
body with its length -- the hub takes it with its head, in one read. Anything else (an
error, another content type) passes through at once. Still the engine's own bytes: no
parsing here. Hang-up is unchanged: the gather runs inside the proxy's disconnect watch, so
a hub that leaves cancels it and the engine's stream is closed. Past `GATHER_LIMIT` what is
held goes out and the rest is relayed as a stream (memory stays bounded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from appliance.http.asgi import Send
from appliance.wire import WHOLE_HEADER

_HEADER = WHOLE_HEADER.encode()
# The most bytes held for one answer: the hub parses a whole answer up to 4 MiB
# (translate/usage.py's WHOLE_LIMIT); a short chat's stream is a few KiB.
GATHER_LIMIT = 4 * 1024 * 1024


def asks_whole(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Did the hub ask for the answer in one body (`WHOLE_HEADER: 1`)?"""
    for k, v in headers:
        if k == _HEADER:
            return v == b"1"
    return False


class Gather:
    """`send` for the proxy: a 200 event stream held and sent in one body at its end."""

    __slots__ = ("_send", "_start", "_parts", "_size")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._start: dict[str, Any] | None = None  # the held head; None: passing through
        self._parts: list[bytes] = []
        self._size = 0

    async def __call__(self, message: dict[str, Any]) -> None:
        start = self._start
        if start is None:
            if message["type"] == "http.response.start" and _gathered(message):
                self._start = message
                return
            await self._send(message)
            return
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if body:
            self._parts.append(body)
            self._size += len(body)
        if more and self._size <= GATHER_LIMIT:
            return
        # The end (or past the bound): the head and all held, then pass the rest through.
        self._start = None
        held, self._parts = b"".join(self._parts), []
        await self._send(start)
        await self._send({"type": "http.response.body", "body": held, "more_body": more})


def _gathered(start: dict[str, Any]) -> bool:
    if start.get("status") != 200:
        return False
    for k, v in start.get("headers") or ():
        if k == b"content-type":
            return bytes(v).startswith(b"text/event-stream")
    return False
