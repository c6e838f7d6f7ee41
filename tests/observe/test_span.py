"""observe/span.py: a record is started as the SDK's tracer starts a span (the provider's
sampler and ids, the parent's context, the trace flags), ends once into the processors,
records nothing when the sampler says not to, and encodes as the SDK's encoder would."""

from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import (  # noqa: E402
    encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from appliance.observe import otlp  # noqa: E402
from tests.harness.sdk import in_memory  # noqa: E402

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def make(sampler=None):
    sdk = in_memory(sampler=sampler)
    tracer = sdk.provider.get_tracer("appliance")
    return sdk.tracing(tracer), tracer, sdk.exporter


def test_a_record_is_started_as_the_sdk_starts_a_span_and_encodes_as_its_encoder_would():
    tracing, tracer, memory = make()
    ours = tracing.start("chat m", [(b"traceparent", f"00-{TRACE}-00f067aa0ba902b7-01".encode()),
                                    (b"tracestate", b"a=b")], attributes={"k": "v"})
    theirs = tracer.start_span("chat m", context=tracing.propagator.extract(
        {"traceparent": f"00-{TRACE}-00f067aa0ba902b7-01", "tracestate": "a=b"}),
        kind=SpanKind.SERVER, attributes={"k": "v"})
    a, b = ours.get_span_context(), theirs.get_span_context()
    assert (a.trace_id, a.trace_flags, a.trace_state, a.is_remote) == (
        b.trace_id, b.trace_flags, b.trace_state, b.is_remote)
    assert ours.parent == theirs.parent and ours.parent.is_remote
    root, sdk_root = tracing.start("r", []), tracer.start_span("r")
    assert root.parent is None and root.get_span_context().trace_flags == \
        sdk_root.get_span_context().trace_flags  # sampled, random trace id
    ours.set_attributes({"n": 3, "f": 0.5, "b": True})
    ours.add_event("first_byte", timestamp=ours.start_time + 5)
    ours.add_event("admission_wait", {"duration_ms": 2.5})
    tracing.error(ours, "upstream 502")
    child = tracing.child(ours, "call")
    child.end()
    ours.end()
    ours.end()  # once only
    ours.set_attribute("late", 1)  # after its end: ignored
    spans = memory.get_finished_spans()
    assert [s.name for s in spans] == ["call", "chat m"]
    assert spans[0].parent == ours.get_span_context() and spans[0].kind is SpanKind.CLIENT
    assert "late" not in spans[1].attributes and spans[1].status.status_code.name == "ERROR"
    assert ExportTraceServiceRequest.FromString(otlp.Encoder().encode(spans)) == \
        encode_spans(spans)


def test_a_record_the_sampler_does_not_keep_names_its_context_and_records_nothing():
    tracing, _, memory = make(ParentBased(ALWAYS_OFF))
    s = tracing.start("chat m", [])
    assert s.get_span_context().is_valid and not s.get_span_context().trace_flags.sampled
    (k, v), = tracing.inject(s)
    assert k == b"traceparent" and v[-2:] in (b"00", b"02")  # not sampled (random id: 02)
    s.set_attributes({"a": 1})
    s.end()
    assert memory.get_finished_spans() == () and s.attributes == {}
    kept = tracing.start("chat m", [(b"traceparent", f"00-{TRACE}-00f067aa0ba902b7-01".encode())])
    kept.end()  # a sampled parent is followed
    (got,) = memory.get_finished_spans()
    assert f"{got.context.trace_id:032x}" == TRACE
