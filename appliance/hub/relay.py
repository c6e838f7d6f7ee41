"""Ending a relayed stream early, cleanly: the node was lost, or the drain ran out.

Theory of operation: the router copies a node's answer to the client chunk by chunk. Two
events may end that copy before the node does -- the node declared lost (its handle's
`lost` event: a SIGSTOPped node would otherwise hold its streams for
Hub__UpstreamReadSeconds) and the end of the drain (`Hub.drain_over`). `Cut` watches
both and cancels only the read in progress, never a write to the client (a write cut
half-way leaves the client's connection in an unknown state). What the client then gets
is decided here: before the first byte, a lost node means "try another node" and a drain
a 503 `shutting_down`; after it, the error event in the stream's own framing
(`stream_error`) and a proper end of the response.
"""

from __future__ import annotations

import trio

from appliance.hub.errors import RouteError, error_body

# Retry-After of a request cut by the drain before its first byte: another hub, or this
# one restarted, takes it a moment later.
SHUTTING_DOWN_RETRY_AFTER = 5.0


class Cut:
    """Why a relay must stop now (`node_lost`, `shutting_down`), and the read it interrupts.

    Only reads from the node are cut, never a write to the client: a write cancelled
    half-way would leave the client's connection in an unknown state. The watchers run
    in the relay's nursery; `trip` cancels the read in progress, and every later read.
    """

    __slots__ = ("reason", "_scope")

    def __init__(self) -> None:
        self.reason = ""
        self._scope: trio.CancelScope | None = None

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

    async def watch(self, event: trio.Event, reason: str) -> None:
        await event.wait()
        self.trip(reason)


def cut_before_answer(cut: Cut) -> tuple[bool, str]:
    if cut.reason == "shutting_down":
        raise RouteError(503, "shutting_down", "the hub is shutting down; retry shortly",
                         retry_after=SHUTTING_DOWN_RETRY_AFTER)
    return False, "was declared lost before answering"


def stream_error(ctype: str, api: str, code: str, msg: str, tail: bytes = b"\n\n") -> bytes:
    """The error event that ends a cut stream, in the stream's own framing: an SSE `data:`
    event (`event: error` first for Anthropic's), or one NDJSON line (which the `ollama`
    client raises as ResponseError). `tail` is the last bytes already sent: the event
    starts on a line of its own, with no blank line an NDJSON reader would choke on."""
    body = error_body(api, 503, code, msg)
    if "event-stream" in ctype:
        sep = b"" if not tail or tail.endswith(b"\n\n") else (b"\n" if tail.endswith(b"\n") else b"\n\n")
        return sep + (b"event: error\n" if api == "anthropic" else b"") + b"data: " + body + b"\n\n"
    sep = b"" if not tail or tail.endswith(b"\n") else b"\n"
    return sep + body + b"\n"
