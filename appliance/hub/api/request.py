"""One inference request as the hub carries it: who, what, where, and what happened.

Owns the record of one inference POST and the way back to its client (`send`). The router
makes it (its id and the headers the node sees read once), the relay (or a worker's lease)
fills it in -- only through its methods: `identified`, `resolved`, `admitted`,
`activated`, `sent_to`, `answered`, `failed`, `refused`, `hung_up` -- and `finish()` reads
the answer's usage once and has the `Recorder` write it, exactly once, whatever ends the
request: one record for the audit line, the page's feeds and the metrics. `finish` runs
through `send_last` just before the last byte goes out (a client that reads its answer
finds the audit line already there), or in the router's outermost `finally` for a
request that never got that far. It decides nothing.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from appliance.bounds import OTHER_LABEL
from appliance.http.asgi import Scope, Send
from appliance.http.errors import ApiError, Headers, render
from appliance.http.stream import delivered, drained
from appliance.hub.decide import limits
from appliance.hub.decide.affinity import Route
from appliance.hub.fleet.nodes import Flag
from appliance.hub.observe.audit import AuditLog, Recent, SlowRequests
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
# `x-request-id`: the client's own when it sent a sane one -- short printable ASCII without
# spaces, so it cannot split a header or an audit line -- else one made here: 128 random
# bits in hex from the process's own generator (seeded from the OS at start, reseeded in a
# forked child): no system call per request. The id names one request in the client's
# logs, the audit line, the node's and the engine's. Longest id kept as given: a UUID is
# 36, a W3C traceparent 55; 128 leaves room for both.
MAX_LEN = 128
_SANE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LEN)


def make() -> str:
    return f"{random.getrandbits(128):032x}"


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The id for a request with these ASGI headers."""
    for k, v in headers:
        if k == b"x-request-id" and _SANE.fullmatch(v) is not None:
            return v.decode("ascii")
    return f"{random.getrandbits(128):032x}"


class Recorder:
    """Where a finished request is written: one record, built once, for the audit log, the
    page's recent and slow feeds (hub/observe/audit.py), then the metrics."""

    def __init__(self, audit: AuditLog, recent: Recent, slow: SlowRequests,
                 metrics: HubMetrics, priority_on: bool) -> None:
        self.audit, self.recent, self.slow, self.metrics = audit, recent, slow, metrics
        self.priority_on = priority_on  # Priority__Enabled (the hub sets it on reload)

    def record(self, req: Request) -> None:
        elapsed = time.perf_counter() - req.t0
        ttfb = req.ttfb
        fields: dict[str, Any] = {"ts": round(time.time(), 3), "kind": "request",
                                  "client": req.client, "model": req.model, "path": req.path,
                                  "status": req.status, "node": req.node,
                                  "ms": round(elapsed * 1000, 2)}
        if req.request_id:
            fields["request_id"] = req.request_id
        if req.trace is not None and req.trace.trace_id:
            fields["trace_id"] = req.trace.trace_id
        batch = req.scope.get(BATCH_SCOPE)
        if batch:
            fields["batch"] = batch  # a batch line (hub/store/runner.py)
        if ttfb is not None:
            fields["ttfb_ms"] = round(ttfb * 1000, 2)
        # Where the time went ("why slow"): `load_ms` the activation wait, `queue_ms`
        # admission's and the slot wait, `node_wait_ms` from the first send to a node to the
        # first byte (a retry included) -- each only where the request got that far.
        if req.load_s is not None:
            fields["load_ms"] = round(req.load_s * 1000, 2)
        if req.queue_s is not None:
            fields["queue_ms"] = round(req.queue_s * 1000, 2)
        if req.sent_at is not None and ttfb is not None:
            fields["node_wait_ms"] = round(max(0.0, req.t0 + ttfb - req.sent_at) * 1000, 2)
        if req.error:
            fields["error"] = req.error
        if self.priority_on:
            fields["priority"] = req.cls
        tokens = req.tokens
        if tokens is not None:
            fields["input_tokens"], fields["output_tokens"] = tokens.input, tokens.output
            if tokens.estimated:
                fields["tokens_estimated"] = True
        route, usage = req.route, req.usage
        if route is not None and route.node:
            fields["routing"] = route.reason
            if usage is not None and usage.cache is not None:  # the engine's word on its cache
                fields["cached_tokens"] = usage.cache[1]
            if route.home_wait is not None:  # it waited for its home node (decide/home.py)
                predicted, waited, outcome = route.home_wait
                fields["home_wait"] = {"predicted_ms": round(predicted * 1000, 1),
                                       "waited_ms": round(waited * 1000, 1),
                                       "outcome": outcome}
        if "cached_tokens" not in fields and usage is not None and usage.cached:
            fields["cached_tokens"] = usage.cached  # as the engine reported it
        if tokens is not None:
            fields.update(token_breakdown(tokens.input, tokens.output,
                                          fields.get("cached_tokens"), ttfb, elapsed))
        self.audit.write(fields)
        self.recent.append(fields)
        self.slow.add(fields)
        m = self.metrics
        m.requests_of(req.client, req.label, str(req.status)).inc()
        if tokens is not None:
            if tokens.input:
                m.tokens_of(req.client, req.label, "input").inc(tokens.input)
            if tokens.output:
                m.tokens_of(req.client, req.label, "output").inc(tokens.output)
        if req.label and req.label != OTHER_LABEL:  # no histogram for names nobody serves
            m.latency_of(req.label).observe(elapsed)
            if ttfb is not None:
                m.ttfb_of(req.label).observe(ttfb)


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
                 "model", "asked", "label", "node", "tried", "status", "ttfb", "error", "done",
                 "scope", "usage", "lease", "tokens", "preempted", "_recorder", "route",
                 "load_s", "queue_s", "sent_at", "load_at", "queue_at", "trace", "forwarded",
                 "id_headers", "_usage_of")

    def __init__(self, scope: Scope, send: Send, api: str, recorder: Recorder) -> None:
        # what
        self.api = api
        self.path: str = scope["path"]
        self.headers: Headers = scope["headers"]
        # One pass over the headers: its id (request_id's rule) and the ones the node sees.
        rid = ""
        self.forwarded: Headers = [JSON_BODY]  # the client's headers the node sees
        for k, v in self.headers:
            if k == b"x-request-id":
                if not rid and _SANE.fullmatch(v) is not None:
                    rid = v.decode("ascii")
            elif k in FORWARD_HEADERS:
                self.forwarded.append((k, v))
        self.request_id = rid or f"{random.getrandbits(128):032x}"
        self.id_headers: Headers = [(b"x-request-id", self.request_id.encode())]
        self.send = send
        self.scope = scope  # the server's hang-up watch (appliance/http/stream.py)
        self.t0 = time.perf_counter()
        # who
        self.client = "anonymous"
        self.cls = "normal"
        # The model as the audit line shows it, and its metrics label: the name once the
        # hub knows the model, else OTHER_LABEL -- a client-chosen name never becomes a
        # series (2,000 unknown names, one series).
        self.model = ""
        self.label = ""
        # The name the client asked for (cut to ECHO_CHARS), before Ollama's tag rule
        # resolved it: the span's gen_ai.request.model.
        self.asked = ""
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
        # Set when essential work takes this background request's place before its first
        # byte (Priority__Preempt): the relay's cut ends it with 503 `preempted`.
        self.preempted = Flag()
        self._recorder = recorder
        # The answer's usage, read once at `finish` (its converter's, translate/usage.py).
        self._usage_of: Callable[[], Usage | None] | None = None

    def finish(self) -> None:
        """Write the audit line and the metrics; once (later calls do nothing). A request
        that never got a status was abandoned by its client: 499."""
        if self.done:
            return
        self.done = True
        self.status = self.status or 499
        if self._usage_of is not None:  # read_usage's, without a call more on every request
            self.usage, self._usage_of = self._usage_of(), None
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

    # --- what happened (the only writers of the record) -----------------------------------

    def identified(self, client: str) -> None:
        self.client = client

    def resolved(self, model: str, label: str, cls: str, asked: str = "") -> None:
        """The model as the audit line shows it, its metrics label, the request's class
        (and the name the client asked for, when it differs)."""
        self.model, self.label, self.cls, self.asked = model, label, cls, asked or model

    def admitted(self, lease: limits.Lease) -> None:
        """Its key's reservation, settled at `finish`."""
        self.lease = lease

    def sent_to(self, node: str, tried: list[str], route: Route | None,
                queued_since: float) -> None:
        """An attempt on `node` (the audit line names where it went, even if it fails) and
        the affinity key admission placed it by, after a wait for a place that began at
        `queued_since` (admission's, then a slot or a home node's: they add up); the first
        one starts node_wait_ms."""
        self.node, self.tried, self.route = node, tried, route
        now = time.perf_counter()
        if self.queue_at is None:
            self.queue_at = queued_since
        self.queue_s = (self.queue_s or 0.0) + now - queued_since
        if self.sent_at is None:
            self.sent_at = now

    def gave_up(self, since: float) -> None:
        """A wait for a place that began at `since` ended without a node (its client left,
        the wait timed out): audited in `queue_ms` all the same -- why it was slow."""
        if self.queue_at is None:
            self.queue_at = since
        self.queue_s = (self.queue_s or 0.0) + time.perf_counter() - since

    def answered(self, node: str, status: int, ttfb: float | None,
                 usage: Callable[[], Usage | None] | None = None) -> None:
        """The node's answer began: its status, the time to its first byte and what tells
        its tokens at the end (its converter's `usage`, read once in `finish`)."""
        self.node, self.status, self.ttfb, self._usage_of = node, status, ttfb, usage

    def read_usage(self) -> Usage | None:
        """The answer's tokens so far, read from its converter once (a hub worker reports
        them when its client hung up mid-answer, before `finish`)."""
        if self._usage_of is not None:
            self.usage, self._usage_of = self._usage_of(), None
        return self.usage

    def counted(self, usage: Usage | None) -> None:
        """The answer's tokens as a hub worker read them (workers/pool.py)."""
        self.usage = usage

    def failed(self, code: str) -> None:
        """The answer was cut short (`node_lost`, `shutting_down`...): its status stands."""
        self.error = code

    def refused(self, status: int, code: str) -> None:
        self.status, self.error = status, code

    def hung_up(self, status: int, code: str) -> None:
        """Its client went away (or the worker holding it died): audited as such, whatever
        had started (what was relayed is counted)."""
        self.status, self.error = status, code

    # --- its waits (audit load_ms, queue_ms, node_wait_ms; the span's events) ---------------

    def traced(self, span: RequestSpan) -> None:
        """Its span: the node continues it; its id may be the trace's (spans.py)."""
        self.trace = span
        self.id_headers = [(b"x-request-id", self.request_id.encode())]
        self.forwarded = [*self.forwarded, *span.headers()]

    def activated(self, since: float) -> None:
        """The activation wait (a model made servable) that began at `since` ended."""
        self.load_at = since
        self.load_s = time.perf_counter() - since

    # --- preemption (admission.py's Preemptible) ----------------------------------------

    def first_byte(self) -> bool:
        """Has the engine's first byte been taken (from then on it is never preempted)?"""
        return self.ttfb is not None or self.done

    def preempt(self) -> None:
        self.preempted.set()

    # --- the way back to the client ----------------------------------------------------

    async def send_start(self, status: int, headers: Headers) -> None:
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def send_last(self, body: bytes) -> None:
        """The last body message: the request is finished (recorded) first -- once what
        was sent has left for the client (a client that read none of a stream the socket
        buffers held is hung up there: audited client_too_slow, never a clean 200)."""
        if not await delivered(self.scope):
            if drained(self.scope):  # the drain ended before the client took it
                self.failed("shutting_down")
            else:
                self.refused(499, "client_too_slow")
            self.finish()
            return
        self.finish()
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def send_error(self, e: ApiError) -> None:
        """A refusal before the response started, in the API's shape."""
        self.refused(e.status, e.code)
        r = render(e, self.api, self.id_headers)
        await self.send_start(r.status, r.headers)
        await self.send_last(r.body)
