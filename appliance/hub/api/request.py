"""One inference request as the hub carries it: who, what, where, and what happened.

Theory of operation: the router makes one `Request` per inference POST and hands it down
the path (router -> admission -> relay) instead of loose values. It holds the way back to
the client (`send`) and everything the audit line and the metrics say about the request.
`finish()` is the one place they are written, exactly once, whatever ends the request:
the relay calls it through `send_last` just before the last byte goes out (a client that
reads its answer finds the audit line already there), the router's outermost `finally`
for a request that never got that far (refused, client gone mid-body, a bug).
"""

from __future__ import annotations

import time
from typing import Any

from appliance.bounds import OTHER_LABEL
from appliance.http.asgi import Scope, Send
from appliance.http.disconnect import delivered, drained
from appliance.http.errors import ApiError, Headers, render
from appliance.hub.api.requestid import request_id
from appliance.hub.decide import limits
from appliance.hub.decide.admission import Demand
from appliance.hub.decide.affinity import Route
from appliance.hub.fleet.flag import Flag
from appliance.hub.observe.audit import AuditLog
from appliance.hub.observe.metrics import HubMetrics
from appliance.hub.observe.spans import RequestSpan
from appliance.hub.translate.usage import Usage

# Headers a client sends that the node should see too; the rest (keys) stay here. Not its
# content-type: the body the hub sends is JSON it checked (or built), whatever the client
# said (litellm's ollama provider and `curl -d` say nothing, or form-urlencoded).
FORWARD_HEADERS = (b"accept", b"user-agent")
JSON_BODY = (b"content-type", b"application/json")
# The scope key of a batch line's batch id (hub/store/runner.py sets it; the audit says it).
BATCH_SCOPE = "appliance.batch"
# Below this much time after the first byte an answer came whole: no decode rate is said.
DECODE_MIN_SECONDS = 0.001


class Recorder:
    """Where a finished request is written: the audit log and the metrics."""

    def __init__(self, audit: AuditLog, metrics: HubMetrics, priority_on: bool) -> None:
        self.audit, self.metrics, self.priority_on = audit, metrics, priority_on

    def record(self, req: Request) -> None:
        elapsed = time.perf_counter() - req.t0
        fields: dict[str, Any] = {"client": req.client, "model": req.model, "path": req.path,
                                  "status": req.status, "node": req.node,
                                  "ms": round(elapsed * 1000, 2)}
        if req.request_id:
            fields["request_id"] = req.request_id
        if req.trace is not None and req.trace.trace_id:
            fields["trace_id"] = req.trace.trace_id
        batch = req.scope.get(BATCH_SCOPE)
        if batch:
            fields["batch"] = batch  # a batch line (hub/store/runner.py)
        if req.ttfb is not None:
            fields["ttfb_ms"] = round(req.ttfb * 1000, 2)
        fields.update(breakdown(req, elapsed))
        if req.error:
            fields["error"] = req.error
        if self.priority_on:
            fields["priority"] = req.cls
        tokens = req.tokens
        if tokens is not None:
            fields["input_tokens"], fields["output_tokens"] = tokens.input, tokens.output
            if tokens.estimated:
                fields["tokens_estimated"] = True
        route = req.route
        if route is not None and route.node:
            fields["routing"] = route.reason
            if route.cached_tokens is not None:
                fields["cached_tokens"] = route.cached_tokens
            if route.home_wait is not None:  # it waited for its home node (decide/home.py)
                predicted, waited, outcome = route.home_wait
                fields["home_wait"] = {"predicted_ms": round(predicted * 1000, 1),
                                       "waited_ms": round(waited * 1000, 1),
                                       "outcome": outcome}
        if "cached_tokens" not in fields and req.usage is not None and req.usage.cached:
            fields["cached_tokens"] = req.usage.cached  # as the engine reported it
        if tokens is not None:
            fields.update(token_breakdown(tokens.input, tokens.output,
                                          fields.get("cached_tokens"), req.ttfb, elapsed))
        self.audit.request(**fields)
        m = self.metrics
        m.requests_of(req.client, req.label, str(req.status)).inc()
        if tokens is not None:
            if tokens.input:
                m.tokens_of(req.client, req.label, "input").inc(tokens.input)
            if tokens.output:
                m.tokens_of(req.client, req.label, "output").inc(tokens.output)
        if req.label and req.label != OTHER_LABEL:  # no histogram for names nobody serves
            m.latency_of(req.label).observe(elapsed)
            if req.ttfb is not None:
                m.ttfb_of(req.label).observe(req.ttfb)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def breakdown(req: Request, elapsed: float) -> dict[str, float]:
    """Where the time went ("why slow"): `load_ms` the activation wait, `queue_ms`
    admission's and the slot wait, `node_wait_ms` from the first send to a node to the
    first byte (a retry included) -- each only where the request got that far."""
    out = {}
    if req.load_s is not None:
        out["load_ms"] = _ms(req.load_s)
    if req.queue_s is not None:
        out["queue_ms"] = _ms(req.queue_s)
    if req.sent_at is not None and req.ttfb is not None:
        out["node_wait_ms"] = _ms(max(0.0, req.t0 + req.ttfb - req.sent_at))
    return out


def token_breakdown(input_tokens: int, output_tokens: int, cached: int | None,
                    ttfb: float | None, elapsed: float) -> dict[str, float]:
    """`prefill_tokens`: the prompt tokens the engine had to compute (input less cached);
    `decode_tps`: output tokens a second after the first byte (a stream's; a whole answer
    has no decode time of its own to divide by)."""
    out: dict[str, float] = {"prefill_tokens": max(0, input_tokens - (cached or 0))}
    if ttfb is not None and output_tokens > 1 and elapsed - ttfb >= DECODE_MIN_SECONDS:
        out["decode_tps"] = round(output_tokens / (elapsed - ttfb), 1)
    return out


class Request:
    """`api` is "openai", "ollama" or "anthropic" (the shape of answers and errors)."""

    __slots__ = ("api", "path", "headers", "request_id", "send", "t0", "client", "cls",
                 "model", "label", "node", "tried", "status", "ttfb", "error", "done",
                 "scope", "usage", "lease", "tokens", "demand", "preempted", "_recorder",
                 "route", "load_s", "queue_s", "sent_at", "load_at", "queue_at", "trace")

    def __init__(self, scope: Scope, send: Send, api: str, recorder: Recorder) -> None:
        # what
        self.api = api
        self.path: str = scope["path"]
        self.headers: Headers = scope["headers"]
        self.request_id = request_id(self.headers)
        self.send = send
        self.scope = scope  # the server's hang-up watch (appliance/http/disconnect.py)
        self.t0 = time.perf_counter()
        # who
        self.client = "anonymous"
        self.cls = "normal"
        # The model as the audit line shows it, and its metrics label: the name once the
        # hub knows the model, else OTHER_LABEL -- a client-chosen name never becomes a
        # series (2,000 unknown names, one series).
        self.model = ""
        self.label = ""
        # where
        self.node = ""
        self.tried: list[str] = []
        # Its affinity key and what became of it (hub/decide/affinity.py); None: none.
        self.route: Route | None = None
        # what happened
        self.status = 0
        self.ttfb: float | None = None
        # where the time went (perf_counter seconds): activation wait, admission and slot
        # waits, and when it was first sent to a node (the audit's breakdown)
        self.load_s: float | None = None
        self.queue_s: float | None = None
        self.sent_at: float | None = None
        self.load_at: float | None = None
        self.queue_at: float | None = None
        # Its span while tracing is on (hub/observe/spans.py), else None.
        self.trace: RequestSpan | None = None
        self.error = ""
        self.done = False
        # tokens: the answer's usage as the relay read it (translate/usage.py: the engine's
        # counts, else the hub's, `estimated`) -- None: no answer was relayed; the key's
        # reservation (limits.py), settled from it at `finish`; what was counted.
        self.usage: Usage | None = None
        self.lease: limits.Lease | None = None
        self.tokens: limits.Settled | None = None
        self.demand: Demand | None = None  # fair queueing's charge (admission.py)
        # Set when essential work takes this background request's place before its first
        # byte (Priority__Preempt): the relay's cut ends it with 503 `preempted`.
        self.preempted = Flag()
        self._recorder = recorder

    def finish(self) -> None:
        """Write the audit line and the metrics; once (later calls do nothing). A request
        that never got a status was abandoned by its client: 499."""
        if self.done:
            return
        self.done = True
        self.status = self.status or 499
        if self.lease is not None:
            # Answered, or hung up mid-answer (what was relayed is counted and charged).
            served = bool(self.node) and (self.status < 400 or (
                self.status == 499 and self.usage is not None))
            # Never answered by an engine (refused, queued out, failed): nothing was used.
            # Counts the hub made itself (the engine gave none) are reported, not settled.
            u = self.usage
            said = (u.input, u.output) if u is not None and not u.estimated else None
            counted = (u.input, u.output) if u is not None and u.estimated else None
            self.tokens = self.lease.settle(said if served else (0, 0), counted)
        self._recorder.record(self)

    # --- preemption (admission.py's Preemptible) ----------------------------------------

    def first_byte(self) -> bool:
        """Has the engine's first byte been taken (from then on it is never preempted)?"""
        return self.ttfb is not None or self.done

    def preempt(self) -> None:
        self.preempted.set()

    # --- the way back to the client ----------------------------------------------------

    def id_headers(self) -> Headers:
        return [(b"x-request-id", self.request_id.encode())] if self.request_id else []

    def forward_headers(self) -> Headers:
        """The client's headers the node sees, the body's type, and the request id."""
        kept = [(k, v) for k, v in self.headers if k in FORWARD_HEADERS]
        if self.trace is not None:  # the node's span continues this request's trace
            kept += self.trace.headers()
        return [JSON_BODY, *kept, *self.id_headers()]

    async def send_start(self, status: int, headers: Headers) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def send_last(self, body: bytes) -> None:
        """The last body message: the request is finished (recorded) first -- once what
        was sent has left for the client (a client that read none of a stream the socket
        buffers held is hung up there: audited client_too_slow, never a clean 200)."""
        if not await delivered(self.scope):
            if drained(self.scope):  # the drain ended before the client took it
                self.error = "shutting_down"
            else:
                self.status, self.error = 499, "client_too_slow"
            self.finish()
            return
        self.finish()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def send_error(self, e: ApiError) -> None:
        """A refusal before the response started, in the API's shape."""
        self.status, self.error = e.status, e.code
        r = render(e, self.api, self.id_headers())
        await self.send_start(r.status, r.headers)
        await self.send_last(r.body)
