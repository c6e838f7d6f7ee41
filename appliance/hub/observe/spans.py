"""One request's trace on the hub: one server span with GenAI attributes, events for each
node attempt and the waits -- all from the request's own record.

Theory of operation: `RequestSpan(tracing, req)` opens the request's span when the router
makes the `Request` (continuing the client's `traceparent` when it sent a valid one) and
gives the request its trace id (the audit's `trace_id`; also its `x-request-id` when the
client sent none, so an error body's id header leads to the trace). `attempt(node)` marks
each node tried with an event; `headers()` is the span's context, which the node
continues (its span a child of this one); `end(req)` closes it from the record in the
router's one `finally`: the GenAI semantic conventions (operation, the model asked for
and the one that answered, usage input/output and cache-read tokens, time to first
token), the client's name (never its key), where it went, the breakdown (load, queue,
node wait) as attributes and as events at their times.
It decides nothing and reads nothing the record does not hold.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from appliance.observe.trace import Tracing, operation, trace_id

if TYPE_CHECKING:
    from appliance.hub.decide.affinity import Route
    from appliance.hub.decide.limits import Settled
    from appliance.hub.translate.usage import Usage


class Request(Protocol):
    """The request record as this module reads it (hub/api/request.py's `Request`)."""

    path: str
    headers: list[tuple[bytes, bytes]]
    t0: float
    request_id: str
    model: str
    asked: str
    client: str
    cls: str
    node: str
    status: int
    error: str
    ttfb: float | None
    load_s: float | None
    load_at: float | None
    queue_s: float | None
    queue_at: float | None
    sent_at: float | None
    tokens: Settled | None
    route: Route | None
    usage: Usage | None

# A wait shorter than this is an attribute only, not also an event (each event costs the
# hub ~5 us to make and as much to export; most requests wait for nothing).
EVENT_MS = 1.0


class RequestSpan:
    __slots__ = ("tracing", "span", "trace_id", "epoch_ns", "perf0", "operation", "context",
                 "attempts", "first_attempt_ns", "ahead")

    def __init__(self, tracing: Tracing, req: Request) -> None:
        self.tracing = tracing
        self.operation = operation(req.path)
        # The record's times are perf_counter seconds from req.t0; spans want epoch ns.
        self.perf0 = req.t0
        self.epoch_ns = time.time_ns() - int((time.perf_counter() - req.t0) * 1e9)
        self.span = tracing.start(self.operation, req.headers, self.epoch_ns,
                                        {"gen_ai.operation.name": self.operation,
                                         "url.path": req.path})
        self.trace_id = trace_id(self.span)
        self.attempts: list[str] = []  # the nodes tried, in order
        self.first_attempt_ns = 0
        self.ahead = 0  # requests for the model waiting when it asked for a place
        self.context: list[tuple[bytes, bytes]] | None = None  # what the node is sent
        if self.trace_id and not any(k == b"x-request-id" for k, _ in req.headers):
            req.request_id = self.trace_id

    def _ns(self, perf: float) -> int:
        """Epoch ns of a perf_counter time: every time of the span from the one clock (the
        wall clock's steps would put an event past the span's end)."""
        return self.epoch_ns + int((perf - self.perf0) * 1e9)

    def attempt(self, node: str) -> None:
        """The request is sent to `node` now (a second call: the first failed before its
        first byte). An event, not a span: one span per request keeps tracing's cost per
        request to one span's (bench/tracing_cost.py)."""
        if self.attempts:  # a retry: each attempt an event (one alone is appliance.node)
            if len(self.attempts) == 1:
                self.span.add_event("node_attempt", {"appliance.node": self.attempts[0],
                                                     "appliance.attempt": 1},
                                    timestamp=self.first_attempt_ns)
            self.span.add_event("node_not_answered", {"appliance.node": self.attempts[-1]})
            self.span.add_event("node_attempt", {"appliance.node": node,
                                                 "appliance.attempt": len(self.attempts) + 1})
        else:
            self.first_attempt_ns = self._ns(time.perf_counter())
        self.attempts.append(node)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """`traceparent` for the node: this request's span (the same for every attempt)."""
        if self.context is None:
            self.context = self.tracing.inject(self.span)
        return self.context

    def end(self, req: Request) -> None:
        s = self.span
        # The conventions' request model is the name the client asked for
        # (`llama3.2:latest`), the response model the one that answered (`llama3.2`).
        model, asked = req.model, req.asked or req.model
        if asked:
            s.update_name(f"{self.operation} {asked}")
        attrs: dict[str, Any] = {
            "gen_ai.request.model": asked, "gen_ai.response.model": model,
            "appliance.client": req.client, "http.response.status_code": req.status,
        }
        if req.node:
            attrs["appliance.node"] = req.node
        if req.request_id and req.request_id != self.trace_id:
            attrs["appliance.request_id"] = req.request_id
        if req.cls:
            attrs["appliance.priority"] = req.cls
        t = req.tokens
        if t is not None:
            attrs["gen_ai.usage.input_tokens"] = t.input
            attrs["gen_ai.usage.output_tokens"] = t.output
        cached = (req.route.cached_tokens if req.route is not None else None) or (
            req.usage.cached if req.usage is not None else None)
        if cached:
            attrs["gen_ai.usage.cache_read.input_tokens"] = cached
        if req.ttfb is not None:
            attrs["gen_ai.server.time_to_first_token"] = round(req.ttfb, 6)
            s.add_event("first_byte", timestamp=self._ns(req.t0 + req.ttfb))
        if req.load_s is not None and req.load_at is not None:
            attrs["appliance.load_ms"] = ms = round(req.load_s * 1000, 2)
            if ms >= EVENT_MS:
                s.add_event("activation_wait", {"duration_ms": ms},
                            timestamp=self._ns(req.load_at))
        if req.queue_s is not None and req.queue_at is not None:
            attrs["appliance.queue_ms"] = ms = round(req.queue_s * 1000, 2)
            if ms >= EVENT_MS:
                s.add_event("admission_wait", {"duration_ms": ms, "appliance.priority": req.cls,
                                                "appliance.queue_position": self.ahead + 1},
                            timestamp=self._ns(req.queue_at))
        if req.sent_at is not None and req.ttfb is not None:
            attrs["appliance.node_wait_ms"] = round(
                max(0.0, req.t0 + req.ttfb - req.sent_at) * 1000, 2)
        if req.error:
            attrs["error.type"] = req.error
        if len(self.attempts) > 1:
            attrs["appliance.attempts"] = len(self.attempts)
        s.set_attributes(attrs)
        if req.status >= 500:
            self.tracing.error(s, req.error or str(req.status))
        s.end(self._ns(time.perf_counter()))  # the clock its events' times come from
