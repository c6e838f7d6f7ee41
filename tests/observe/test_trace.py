"""observe/trace.py without processes: off costs no import, context headers are bounded,
and export never blocks -- a full queue and a failed export are counted as drops."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from appliance.observe import trace


def test_off_without_an_endpoint_imports_nothing():
    code = ("import sys; import appliance.hub.hub, appliance.hub.api.router, appliance.node.run;"
            "from appliance.observe import trace; assert trace.setup('x', {}) is None;"
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not trace.enabled({}) and not trace.enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": " "})
    assert trace.enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})


def test_context_headers_of_a_sane_size_only():
    tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    got = trace.carrier([(b"traceparent", tp), (b"tracestate", b"a=b"), (b"x", b"y")])
    assert got == {"traceparent": tp.decode(), "tracestate": "a=b"}
    assert trace.carrier([(b"traceparent", b"0" * 5000), (b"tracestate", b"s" * 600)]) == {}
    assert trace.passthrough([(b"traceparent", tp), (b"tracestate", b"s" * 600)]) == [
        (b"traceparent", tp)]
    assert trace.operation("/api/embed") == "embeddings" and trace.operation("/x") == "chat"


def test_a_full_queue_and_a_failed_export_are_counted_never_blocking(monkeypatch):
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider

    release = threading.Event()
    exported: list[int] = []

    class Stuck:  # observe/otlp.py's Exporter, as the processor uses it
        def export(self, spans):  # the collector hangs, then refuses
            release.wait(30)
            exported.append(len(spans))
            return False

        def shutdown(self):
            pass

    monkeypatch.setattr(trace, "MAX_QUEUE", 10)
    monkeypatch.setattr(trace, "MAX_BATCH", 100)
    drops = trace.Drops()
    processor = trace._processor(Stuck(), drops)
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    tracer.start_span("first").end()
    for _ in range(200):  # while the export thread is stuck: no call waits
        tracer.start_span("s").end()
    assert drops.full >= 190 - 10 and drops.failed == 0
    release.set()
    processor.shutdown()
    assert sum(exported) == drops.failed and drops.failed >= 1
    assert drops.total == drops.full + drops.failed
