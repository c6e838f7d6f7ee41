"""One span as the hub and the node make them, in place of the SDK's `Span`.

Theory of operation: the SDK's span checks and copies every attribute behind a lock, makes
an event object per event and a readable copy at its end -- 90-120 µs a request on the
hub's trio thread at load, most of tracing's cost (docs/benchmarks.md). `Record` is a plain
object with the names span processors and observe/otlp.py read (context, parent, name,
kind, start and end times, attributes, events, status, resource, scope, links and dropped
counts) and the few methods this code calls. `Maker.start` decides as the SDK's tracer
does, with the provider's own sampler and id generator (so `OTEL_TRACES_SAMPLER` works
unchanged): the parent from the request's context, the sampler's decision, attributes and
tracestate, the trace flags (sampled, random trace id); a span the sampler does not record
still names its context for the next hop. The attributes are ours (strings, numbers,
booleans), taken as given. Processors' `on_start` is not called (ours do nothing there).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace as api
from opentelemetry.context import Context
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

SCOPE = InstrumentationScope("appliance")
UNSET = Status(StatusCode.UNSET)


class Event:
    __slots__ = ("name", "timestamp", "attributes")
    dropped_attributes = 0

    def __init__(self, name: str, timestamp: int, attributes: dict[str, Any]) -> None:
        self.name, self.timestamp, self.attributes = name, timestamp, attributes


class Record:
    """A span being made, then ended (read by the processors like the SDK's ReadableSpan)."""

    __slots__ = ("name", "context", "parent", "kind", "start_time", "end_time", "attributes",
                 "events", "status", "resource", "_processor")
    instrumentation_scope = SCOPE
    links = ()
    dropped_attributes = dropped_events = dropped_links = 0

    def __init__(self, name: str, context: SpanContext, parent: SpanContext | None,
                 kind: SpanKind, start_time: int, attributes: dict[str, Any], resource: Any,
                 processor: SpanProcessor | None) -> None:
        self.name, self.context, self.parent, self.kind = name, context, parent, kind
        self.start_time = start_time
        self.end_time: int | None = None
        self.attributes = attributes
        self.events: list[Event] = []
        self.status = UNSET
        self.resource = resource
        self._processor = processor  # None: not recorded (the sampler said so)

    def get_span_context(self) -> SpanContext:
        return self.context

    def _open(self) -> bool:
        return self._processor is not None and self.end_time is None

    def set_attribute(self, key: str, value: Any) -> None:
        if self._open():
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self._open():
            self.attributes.update(attributes)

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None,
                  timestamp: int | None = None) -> None:
        if self._open():
            self.events.append(Event(name, timestamp if timestamp is not None
                                     else time.time_ns(), dict(attributes or {})))

    def update_name(self, name: str) -> None:
        if self._open():
            self.name = name

    def set_status(self, status: Status) -> None:
        if self._open() and self.status.status_code is not StatusCode.OK:
            self.status = status

    def end(self, end_time: int | None = None) -> None:
        if not self._open():
            return
        self.end_time = end_time if end_time is not None else time.time_ns()
        assert self._processor is not None
        self._processor.on_end(self)  # type: ignore[arg-type]  # read as a ReadableSpan


class Maker:
    """Starts records with a tracer's sampler, id generator, resource and processors."""

    def __init__(self, tracer: Any) -> None:  # the SDK's Tracer (its attributes are public)
        self.sampler, self.ids = tracer.sampler, tracer.id_generator
        self.resource, self.processor = tracer.resource, tracer.span_processor

    def start(self, name: str, context: Context | None, kind: SpanKind,
              start_ns: int | None = None,
              attributes: dict[str, Any] | None = None) -> Record:
        parent: SpanContext | None = api.get_current_span(context).get_span_context()
        if parent is None or not parent.is_valid:
            parent = None
            trace_id = self.ids.generate_trace_id()
            random = self.ids.is_trace_id_random()
        else:
            trace_id = parent.trace_id
            random = parent.trace_flags.random_trace_id
        result = self.sampler.should_sample(context, trace_id, name, kind, attributes, ())
        decision: Any = result.decision  # (its methods are untyped)
        flags = TraceFlags.SAMPLED if decision.is_sampled() else TraceFlags.DEFAULT
        if random:
            flags |= TraceFlags.RANDOM_TRACE_ID
        ctx = SpanContext(trace_id, self.ids.generate_span_id(), is_remote=False,
                          trace_flags=TraceFlags(flags), trace_state=result.trace_state)
        recording = decision.is_recording()
        return Record(name, ctx, parent, kind,
                      start_ns if start_ns is not None else time.time_ns(),
                      dict(result.attributes or {}) if recording else {}, self.resource,
                      self.processor if recording else None)
