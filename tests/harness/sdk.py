"""OpenTelemetry's own SDK with its spans kept in memory: the oracle the tests of what the
hub and node trace compare against (observe/otlp.py's encoding, observe/span.py's records,
hub/observe/spans.py's request span). One provider a test, never the global one."""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Tracer, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from appliance.observe.trace import Drops, Tracing


@dataclass
class InMemory:
    provider: TracerProvider
    processor: SimpleSpanProcessor
    exporter: InMemorySpanExporter  # .get_finished_spans(): every span ended so far

    def tracing(self, tracer: Tracer) -> Tracing:
        """What the hub's tracing is once set up, with `tracer` and this processor."""
        return Tracing(tracer, TraceContextTextMapPropagator(), self.processor, Drops())


def in_memory(resource: Resource | None = None, sampler: Sampler | None = None) -> InMemory:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=resource or Resource({"service.name": "hub"}),
                              shutdown_on_exit=False, **({"sampler": sampler} if sampler else {}))
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return InMemory(provider, processor, exporter)
