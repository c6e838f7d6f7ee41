"""OpenTelemetry traces for the hub and the node, configured by the standard OTEL_* names.

Theory of operation: `setup(service)` returns None -- and imports nothing of OpenTelemetry,
so a process without tracing pays nothing -- unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set. Then it builds a TracerProvider whose sampler
is `OTEL_TRACES_SAMPLER` / `_ARG` (the SDK reads them; default parent-based always-on),
whose resource is `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` over our default
service name, exporting OTLP/HTTP protobuf to that endpoint (`/v1/traces` appended),
encoded and posted by observe/otlp.py (the SDK's encoder cost as much as the request).
Spans are observe/span.py's records, started with that provider's sampler and ids (the
SDK's own span cost most of tracing's CPU).

Export never blocks or fails a request: an ended span goes into a bounded queue
(`MAX_QUEUE`) with a non-blocking put, and one daemon thread wakes once a second to
export what is queued, in batches. A full
queue drops the span; a failed export (collector down, slow past its timeout) drops the
batch; both are counted (`dropped`, served as `appliance_spans_dropped_total`).

Context crosses processes as W3C `traceparent` / `tracestate`: `start` continues the one
a request came with -- only when it is of a sane size; the propagator ignores garbage, so a
bad header starts a new trace and is never echoed -- and `inject` gives the headers for
the next hop (hub -> node -> engine).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the real imports are in setup(): none without an endpoint
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    from appliance.observe.otlp import Exporter
    from appliance.observe.span import Record as Span

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# Spans waiting for export: the SDK's own BatchSpanProcessor default. At ~1 KiB a span
# that is 2 MiB at most, whatever the collector does.
MAX_QUEUE = 2048
# Spans per export request, and how often the export thread wakes to send what is queued
# -- sooner when a whole batch is waiting (the SDK's defaults: 512, 5 s; 1 s here so a
# trace shows promptly).
MAX_BATCH = 512
BATCH_SECONDS = 1.0
# On exit: how long the last spans may take to leave.
SHUTDOWN_SECONDS = 2.0
# W3C Trace Context: a version-00 traceparent is 55 characters, a tracestate at most 32
# members of ~256; anything longer is not one, and is ignored unread.
TRACEPARENT_MAX = 128
TRACESTATE_MAX = 512

Headers = Iterable[tuple[bytes, bytes]]

# gen_ai.operation.name by route (the GenAI conventions' well-known values).
OPERATIONS = {"/v1/chat/completions": "chat", "/api/chat": "chat", "/v1/messages": "chat",
              "/v1/responses": "chat", "/v1/completions": "text_completion",
              "/api/generate": "text_completion", "/v1/embeddings": "embeddings",
              "/api/embed": "embeddings", "/api/embeddings": "embeddings"}


def operation(path: str) -> str:
    return OPERATIONS.get(path, "chat")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return any(environ.get(v, "").strip() for v in ENDPOINT_VARS)


def carrier(headers: Headers) -> dict[str, str]:
    """The trace context headers of a request, those of a sane size only."""
    out: dict[str, str] = {}
    for k, v in headers:
        if k == b"traceparent" and len(v) <= TRACEPARENT_MAX:
            out["traceparent"] = v.decode("latin-1")
        elif k == b"tracestate" and len(v) <= TRACESTATE_MAX:
            out["tracestate"] = v.decode("latin-1")
    return out


def passthrough(headers: Headers) -> list[tuple[bytes, bytes]]:
    """The trace context headers of a sane size, as they came (a hop that does not trace
    still hands its caller's context on)."""
    return [(k, v) for k, v in headers
            if (k == b"traceparent" and len(v) <= TRACEPARENT_MAX)
            or (k == b"tracestate" and len(v) <= TRACESTATE_MAX)]


class Drops:
    """Spans dropped: at a full queue (counted on the trio thread) and in failed exports
    (counted on the export thread) -- one writer each, summed when read."""

    def __init__(self) -> None:
        self.full = 0
        self.failed = 0

    @property
    def total(self) -> int:
        return self.full + self.failed


def _processor(exporter: Exporter, drops: Drops) -> SpanProcessor:
    """A span processor that never blocks: a bounded queue and one export thread."""
    from opentelemetry.sdk.trace import SpanProcessor

    class QueueProcessor(SpanProcessor):
        def __init__(self) -> None:
            # A deque: append and popleft are atomic, no lock and condition per span as
            # queue.Queue takes; its bound is MAX_QUEUE, checked here.
            self.queue: deque[ReadableSpan] = deque()
            self.stop = threading.Event()
            self.wake = threading.Event()
            self.pending = 0
            self.failing = False
            self.thread = threading.Thread(target=self._run, name="appliance-otlp",
                                           daemon=True)
            self.thread.start()

        def on_end(self, span: ReadableSpan) -> None:
            if span.context is None or not span.context.trace_flags.sampled:
                return
            if len(self.queue) >= MAX_QUEUE:
                drops.full += 1
                return
            self.queue.append(span)
            self.pending += 1  # (approximate: read and reset by the export thread)
            if self.pending == MAX_BATCH:
                self.wake.set()  # a full batch goes before its second is up

        def _run(self) -> None:
            # Wakes once a BATCH_SECONDS, never per span: a getter blocked on the queue would
            # be woken (a thread switch, the GIL handed over) by every span the hub ends.
            while True:
                self.wake.wait(BATCH_SECONDS)
                self.wake.clear()
                self.pending = 0
                stopped = self.stop.is_set()
                while True:
                    batch: list[ReadableSpan] = []
                    while len(batch) < MAX_BATCH:
                        try:
                            batch.append(self.queue.popleft())
                        except IndexError:
                            break
                    if not batch:
                        break
                    self._export(batch)
                if stopped:
                    return

        def _export(self, batch: list[ReadableSpan]) -> None:
            try:
                ok = exporter.export(batch)
            except Exception:  # an exporter's bug must not end the thread
                log.exception("span export failed")
                ok = False
            if not ok:
                drops.failed += len(batch)
            if ok == self.failing:  # said when it starts failing and when it recovers
                self.failing = not ok
                if ok:
                    log.info("spans are exported again")
                else:
                    log.warning("span export failed: spans are dropped (counted in "
                                "appliance_spans_dropped_total) until the collector answers")

        def shutdown(self) -> None:
            self.stop.set()
            self.wake.set()
            self.thread.join(SHUTDOWN_SECONDS)
            exporter.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return not self.queue

    return QueueProcessor()


class Tracing:
    """The process's tracer, its propagator and its drop count."""

    def __init__(self, tracer: Any, propagator: TraceContextTextMapPropagator,
                 processor: SpanProcessor, drops: Drops) -> None:
        self.tracer, self.propagator, self.processor = tracer, propagator, processor
        self.drops = drops
        from opentelemetry import trace as api  # already imported by setup()
        from opentelemetry.context import Context
        from opentelemetry.trace import SpanKind

        from appliance.observe.span import Maker
        self._api, self._kind, self._context = api, SpanKind, Context
        # Spans are observe/span.py's records, made with this tracer's sampler and ids.
        self._maker = Maker(tracer)

    @property
    def dropped(self) -> int:
        return self.drops.total

    def start(self, name: str, headers: Headers, start_ns: int | None = None,
              attributes: dict[str, Any] | None = None) -> Span:
        """A server span continuing the request's own trace context when it has a valid one."""
        found = carrier(headers)
        ctx = self.propagator.extract(found) if found else self._context()
        return self._maker.start(name, ctx, self._kind.SERVER, start_ns, attributes)

    def child(self, parent: Span, name: str, start_ns: int | None = None,
              attributes: dict[str, Any] | None = None) -> Span:
        """A client span under `parent` (a call to the next hop)."""
        ctx = self._api.set_span_in_context(self._api.NonRecordingSpan(parent.get_span_context()))
        return self._maker.start(name, ctx, self._kind.CLIENT, start_ns, attributes)

    def inject(self, span: Span) -> list[tuple[bytes, bytes]]:
        """`traceparent` (and `tracestate`) naming `span` as the next hop's parent: what
        the W3C propagator writes, formatted here (it costs a context and a lookup)."""
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return []
        out = [(b"traceparent",
                f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}".encode())]
        state = ctx.trace_state.to_header() if ctx.trace_state else ""
        if state:
            out.append((b"tracestate", state.encode("latin-1")))
        return out

    def error(self, span: Span, what: str) -> None:
        span.set_status(self._api.Status(self._api.StatusCode.ERROR, what[:200]))

    def shutdown(self) -> None:
        self.processor.shutdown()


def trace_id(span: Span) -> str:
    """The span's trace id as 32 hex digits ("" for an invalid one)."""
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.trace_id else ""


def setup(service: str, environ: Mapping[str, str] = os.environ) -> Tracing | None:
    """Tracing configured from the OTEL_* variables; None (nothing imported) without an
    endpoint."""
    if not enabled(environ):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""):
        resource = resource.merge(Resource({"service.name": service}))
    from appliance.observe.otlp import Exporter

    drops = Drops()
    processor = _processor(Exporter(environ), drops)
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("appliance")
    endpoint = next(environ[v] for v in ENDPOINT_VARS if environ.get(v, "").strip())
    log.info("tracing to %s as %s (OTEL_TRACES_SAMPLER=%s)", endpoint,
             resource.attributes.get("service.name"),
             environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on"))
    return Tracing(tracer, TraceContextTextMapPropagator(), processor, drops)


class DroppedCollector:
    """`appliance_spans_dropped_total` at each scrape (registered only while tracing)."""

    def __init__(self, tracing: Tracing) -> None:
        self.tracing = tracing

    def collect(self) -> list[Any]:
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily("appliance_spans_dropped",
                                  "Spans dropped instead of exported: the export queue was full "
                                  "or the collector failed or was too slow.")
        fam.add_metric([], float(self.tracing.dropped))
        return [fam]

    def describe(self) -> list[Any]:
        return self.collect()
