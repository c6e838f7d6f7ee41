"""observe/otlp.py: the hand-written OTLP encoding decodes to what the SDK's encoder
builds, for every kind of attribute, event, link, status and parent; the exporter reads the
standard variables and posts (gzip too) to a collector."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from opentelemetry.exporter.otlp.proto.common.trace_encoder import (  # noqa: E402
    encode_spans,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.resources import Resource  # noqa: E402
from opentelemetry.trace import Link, SpanKind, Status, StatusCode  # noqa: E402
from opentelemetry.trace.propagation.tracecontext import (  # noqa: E402
    TraceContextTextMapPropagator,
)

from appliance.observe import otlp  # noqa: E402
from tests.harness.sdk import in_memory  # noqa: E402


def spans():
    sdk = in_memory(Resource({"service.name": "hub", "n": 3}, schema_url="https://x/s"))
    provider = sdk.provider
    tracer = provider.get_tracer("appliance", "1.2", schema_url="https://x/t")
    other = provider.get_tracer("other")
    ctx = TraceContextTextMapPropagator().extract({
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "a=b,c=d"})
    server = tracer.start_span("chat m", context=ctx, kind=SpanKind.SERVER, attributes={
        "gen_ai.operation.name": "chat", "s": "", "i": 7, "neg": -5, "big": 2**62,
        "b": True, "f": False, "x": 0.25, "strs": ("a", "b"), "ints": [1, 2], "ü": "é"})
    server.add_event("first_byte")
    server.add_event("admission_wait", {"duration_ms": 3.5, "appliance.queue_position": 2})
    server.set_status(Status(StatusCode.ERROR, "upstream 502"))
    child = tracer.start_span("call", kind=SpanKind.CLIENT,
                              links=[Link(server.get_span_context(), {"k": "v"})])
    child.set_status(Status(StatusCode.OK))
    child.end()
    server.end()
    for _ in range(3):  # the same attributes again: from the cache
        s = other.start_span("again", attributes={"gen_ai.operation.name": "chat", "i": 7})
        s.end()
    return sdk.exporter.get_finished_spans()


def test_the_encoding_decodes_to_what_the_sdk_encoder_builds():
    got = spans()
    assert len(got) == 5
    enc = otlp.Encoder()
    for _ in range(2):  # the second time from the caches
        ours = ExportTraceServiceRequest.FromString(enc.encode(got))
        assert ours == encode_spans(got)
    theirs = encode_spans(got)
    assert ours.resource_spans[0].scope_spans[0].spans[0].attributes == \
        theirs.resource_spans[0].scope_spans[0].spans[0].attributes


class Collector(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.got: list[tuple[str, dict[str, str], bytes]] = []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: Collector
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        self.server.got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        self.send_response(self.server.status)
        self.send_header("content-length", "0")
        self.end_headers()


def test_the_exporter_reads_the_standard_variables_and_posts_to_the_collector():
    c = Collector()
    # (a stop looks every 0.05 s, not the stdlib's 0.5 s)
    threading.Thread(target=c.serve_forever, args=(0.05,), daemon=True).start()
    try:
        base = f"http://127.0.0.1:{c.server_address[1]}"
        e = otlp.Exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": base + "/",
                           "OTEL_EXPORTER_OTLP_HEADERS": "api-key=s%20t,x=y",
                           "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
                           "OTEL_EXPORTER_OTLP_TIMEOUT": "3"})
        assert e.url == base + "/v1/traces" and e.timeout == 3.0
        got = spans()
        assert e.export(got) and e.export(got[:1])  # the second on the same connection
        path, headers, body = c.got[0]
        assert path == "/v1/traces"
        assert headers["api-key"] == "s t" and headers["x"] == "y"
        assert headers["content-type"] == "application/x-protobuf"
        assert headers["content-encoding"] == "gzip"
        assert ExportTraceServiceRequest.FromString(gzip.decompress(body)) == encode_spans(got)
        assert otlp.Exporter({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": base + "/custom",
                              "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere"}).url == \
            base + "/custom"
        c.status = 503
        assert not e.export(got)
        e.shutdown()
    finally:
        c.shutdown()
        c.server_close()
    assert not otlp.Exporter({"OTEL_EXPORTER_OTLP_ENDPOINT": base, "OTEL_EXPORTER_OTLP_TIMEOUT":
                              "1"}).export(got)  # nobody listening: a failure, not a raise
