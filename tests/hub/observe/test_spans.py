"""The hub's request span (hub/observe/spans.py) from a request record, without processes:
the client's context continued or garbage ignored, the request id tied to the trace, the
GenAI attributes, and a retried request's attempts as events."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from appliance.hub.observe.spans import RequestSpan  # noqa: E402
from tests.harness.sdk import in_memory  # noqa: E402

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE}-00f067aa0ba902b7-01".encode()


@pytest.fixture
def tracing():
    sdk = in_memory()
    t = sdk.tracing(sdk.provider.get_tracer("t"))
    t.exporter = sdk.exporter
    return t


def _req(headers, **kw):
    t0 = time.perf_counter()
    base = dict(path="/v1/chat/completions", headers=headers, t0=t0, request_id="made-here",
                model="m", asked="m", client="team-a", cls="normal", node="", status=0, error="",
                ttfb=None, load_s=None, load_at=None, queue_s=None, queue_at=None,
                sent_at=None, tokens=None, route=None, usage=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_a_clients_trace_is_continued_and_the_attributes_come_from_the_record(tracing):
    req = _req([(b"traceparent", PARENT), (b"x-request-id", b"mine")])
    span = RequestSpan(tracing, req)
    span.ahead = 3
    assert span.trace_id == TRACE and req.request_id == "made-here"  # the client's id kept
    span.attempt("gpu-a")
    (k, v), = span.headers()
    assert k == b"traceparent" and v.startswith(f"00-{TRACE}-".encode())
    req.node, req.status, req.ttfb = "gpu-a", 200, 0.25
    req.queue_s, req.queue_at = 0.5, req.t0
    req.tokens = SimpleNamespace(input=12, output=30)
    req.usage = SimpleNamespace(cached=8)
    span.end(req)
    (s,) = tracing.exporter.get_finished_spans()
    assert s.name == "chat m" and s.parent.span_id == 0x00f067aa0ba902b7
    a = s.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    assert a["gen_ai.usage.input_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 30
    assert a["gen_ai.usage.cache_read.input_tokens"] == 8
    assert a["gen_ai.server.time_to_first_token"] == 0.25
    assert a["appliance.client"] == "team-a" and a["appliance.queue_ms"] == 500.0
    assert a["appliance.request_id"] == "made-here"
    assert {e.name for e in s.events} == {"first_byte", "admission_wait"}
    wait = next(e for e in s.events if e.name == "admission_wait")
    assert wait.attributes["appliance.queue_position"] == 4  # three were waiting
    assert v.split(b"-")[2] == f"{s.context.span_id:016x}".encode()  # the node's parent


def test_no_or_garbage_context_starts_a_trace_that_names_the_request(tracing):
    for headers in ([], [(b"traceparent", b"garbage")], [(b"traceparent", b"0" * 4000)],
                    [(b"traceparent", PARENT + b"ff" * 100)]):
        req = _req(headers)
        span = RequestSpan(tracing, req)
        assert span.trace_id != TRACE and len(span.trace_id) == 32
        assert req.request_id == span.trace_id  # no x-request-id came: the trace id is it
        span.end(req)
    for s in tracing.exporter.get_finished_spans():
        assert s.parent is None
        assert "garbage" not in str(dict(s.attributes)) and "0000" * 10 not in str(
            dict(s.attributes))


def test_a_retried_request_shows_each_attempt(tracing):
    req = _req([])
    span = RequestSpan(tracing, req)
    span.attempt("gpu-a")
    span.attempt("gpu-b")
    req.node, req.status = "gpu-b", 503
    req.error = "no_capacity"
    span.end(req)
    (s,) = tracing.exporter.get_finished_spans()
    names = [(e.name, e.attributes.get("appliance.node")) for e in s.events]
    assert names == [("node_attempt", "gpu-a"), ("node_not_answered", "gpu-a"),
                     ("node_attempt", "gpu-b")]
    assert s.attributes["appliance.attempts"] == 2 and s.attributes["error.type"] == "no_capacity"
    assert s.status.status_code.name == "ERROR"


def test_the_request_model_is_the_name_asked_for_the_response_model_the_one_served(tracing):
    req = _req([], model="llama3.2", asked="llama3.2:latest", status=200)
    RequestSpan(tracing, req).end(req)
    (s,) = tracing.exporter.get_finished_spans()
    assert s.name == "chat llama3.2:latest"  # {operation} {gen_ai.request.model}
    assert s.attributes["gen_ai.request.model"] == "llama3.2:latest"
    assert s.attributes["gen_ai.response.model"] == "llama3.2"
