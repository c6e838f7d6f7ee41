"""OpenTelemetry traces with real processes: a hub and a node (engine kind `openai`) in front
of a small engine that records what it is sent, both exporting OTLP/HTTP to a receiver in
this test that decodes with opentelemetry-proto. One trace id runs from the client's
`traceparent` through the hub's and the node's spans to the engine; the hub's span has
the GenAI attributes; garbage context is ignored; a dead receiver costs no request and its
drops are counted."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import Procs, wait_until

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
)

pytestmark = pytest.mark.e2e

TOKEN = "trace-token"
MODEL = "tiny"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Engine(ThreadingHTTPServer):
    """An OpenAI-compatible engine: one model, a three-token stream with usage; it keeps the
    traceparent of each chat it is sent."""

    daemon_threads = True

    def __init__(self) -> None:
        self.traceparents: list[str] = []
        super().__init__(("127.0.0.1", 0), _EngineHandler)


class _EngineHandler(BaseHTTPRequestHandler):
    server: Engine

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.endswith("/chat/completions"):
            self.server.traceparents.append(self.headers.get("traceparent") or "")
        chunks = [{"choices": [{"index": 0, "delta": {"content": w}}]} for w in ("a", "b", "c")]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                "total_tokens": 10}})
        body = b"".join(b"data: " + json.dumps({"id": "x", "object": "chat.completion.chunk",
                                               "model": MODEL, **c}).encode() + b"\n\n"
                        for c in chunks) + b"data: [DONE]\n\n"
        self._send(200, body, "text/event-stream")


class Receiver(ThreadingHTTPServer):
    """An OTLP/HTTP traces receiver: every span it is sent, as (service, span) pairs."""

    daemon_threads = True

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ReceiverHandler)

    def named(self, prefix: str) -> list:
        with self.lock:
            return [s for _, s in self.spans if s.name.startswith(prefix)]

    def of(self, service: str) -> list:
        with self.lock:
            return [s for svc, s in self.spans if svc == service]


class _ReceiverHandler(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *args):
        pass

    def do_POST(self):
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        req = ExportTraceServiceRequest()
        req.ParseFromString(raw)
        with self.server.lock:
            for rs in req.resource_spans:
                svc = next((a.value.string_value for a in rs.resource.attributes
                            if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    self.server.spans.extend((svc, s) for s in ss.spans)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()


def _serve(server: ThreadingHTTPServer) -> str:
    # (its shutdown() looks every 0.05 s, not the stdlib's 0.5 s)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = (v.string_value if v.HasField("string_value") else v.int_value
                      if v.HasField("int_value") else v.double_value
                      if v.HasField("double_value") else v.bool_value)
    return out


def _stream(url: str, headers: dict, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers,
                      timeout=30) as r:
        r.read()
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
    return r


@pytest.fixture(params=["1"], ids=["one-process"])
def workers(request) -> str:
    return request.param


@pytest.fixture
def fleet(procs: Procs, tmp_path, workers):
    engine, receiver = Engine(), Receiver()
    engine_url, receiver_url = _serve(engine), _serve(receiver)
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver_url, "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    audit = tmp_path / "audit.jsonl"
    hub = f.start_hub({"Audit__Path": str(audit), "Hub__Workers": workers, **otel})
    f.start_node("gpu-a", {"Node__AnnounceSeconds": "1", "Engine__Kind": "openai",
                           "Engine__Url": engine_url, "Engine__PollSeconds": "1",
                           "Node__ProbeSeconds": "0", **otel})
    f.wait(lambda: httpx.get(hub.url + "/v1/models", timeout=30).json()["data"],
           "the model listed")
    try:
        yield hub, engine, receiver, audit
    finally:
        receiver.shutdown()
        engine.shutdown()


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "two-workers"],
                         indirect=True)
def test_one_trace_from_the_client_through_hub_and_node_to_the_engine(fleet):
    hub, engine, receiver, audit = fleet
    parent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    r = _stream(hub.url, {"traceparent": parent, "x-request-id": "req-1"})
    assert r.headers["x-request-id"] == "req-1"
    def names(service: str) -> set[str]:
        return {s.name for s in receiver.of(service)}
    wait_until(lambda: "chat tiny" in names("appliance-hub")
               and "chat tiny" in names("appliance-node"), 30, "hub and node spans exported")
    hub_span = next(s for s in receiver.of("appliance-hub") if s.name == "chat tiny")
    node_span = next(s for s in receiver.of("appliance-node") if s.name == "chat tiny")
    # The client's trace continued: one trace id everywhere, each span the child of the last.
    for s in (hub_span, node_span):
        assert s.trace_id.hex() == CLIENT_TRACE
    assert hub_span.parent_span_id.hex() == CLIENT_SPAN
    assert node_span.parent_span_id == hub_span.span_id
    # The engine got the node span's context.
    assert engine.traceparents[-1] == f"00-{CLIENT_TRACE}-{node_span.span_id.hex()}-01"
    a = _attrs(hub_span)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] == 7 and a["gen_ai.usage.output_tokens"] == 3
    assert 0 < a["gen_ai.server.time_to_first_token"] < 30
    assert a["appliance.client"] == "anonymous" and a["appliance.node"] == "gpu-a"
    assert a["http.response.status_code"] == 200
    first = next(e for e in hub_span.events if e.name == "first_byte")
    assert hub_span.start_time_unix_nano <= first.time_unix_nano <= hub_span.end_time_unix_nano
    assert "node_attempt" not in {e.name for e in hub_span.events}  # one attempt: the attribute
    line = [json.loads(x) for x in audit.read_text().splitlines() if '"request"' in x][-1]
    assert line["trace_id"] == CLIENT_TRACE and line["request_id"] == "req-1"


@pytest.mark.parametrize("workers", ["1", "2"], ids=["one-process", "two-workers"],
                         indirect=True)
def test_the_request_model_is_the_name_asked_for_and_the_response_model_the_one_served(fleet):
    """GenAI conventions: gen_ai.request.model is the client's own name (Ollama's tag rule
    resolves `tiny:latest` to `tiny`), gen_ai.response.model the model that answered."""
    hub, engine, receiver, audit = fleet
    _stream(hub.url, {}, model=f"{MODEL}:latest")
    wait_until(lambda: receiver.named(f"chat {MODEL}:latest"), 30, "the hub's span exported")
    (s,) = [s for s in receiver.named(f"chat {MODEL}:latest")
            if s in receiver.of("appliance-hub")]
    a = _attrs(s)
    assert a["gen_ai.request.model"] == f"{MODEL}:latest" and a["gen_ai.response.model"] == MODEL
    line = [json.loads(x) for x in audit.read_text().splitlines() if '"request"' in x][-1]
    assert line["model"] == MODEL  # the audit and the metrics keep the resolved name


def test_no_or_garbage_traceparent_starts_a_new_trace_tied_to_the_request_id(fleet):
    hub, engine, receiver, audit = fleet
    r = _stream(hub.url, {})
    rid = r.headers["x-request-id"]
    for bad in ("00-" + "z" * 32 + "-" + "1" * 16 + "-01", "x" * 5000,
                f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01" + "f" * 200):
        _stream(hub.url, {"traceparent": bad})
    lines = [json.loads(x) for x in audit.read_text().splitlines() if '"request"' in x]
    assert lines[0]["trace_id"] == rid and re.fullmatch(r"[0-9a-f]{32}", rid)
    ids = {x["trace_id"] for x in lines}
    assert len(ids) == 4 and CLIENT_TRACE not in ids
    wait_until(lambda: len(receiver.named("chat tiny")) >= 8, 30, "spans of all four")
    for s in receiver.named("chat tiny"):
        assert "z" * 8 not in str(_attrs(s)) and "x" * 100 not in str(_attrs(s))


def test_a_dead_receiver_costs_no_request_and_its_drops_are_counted(fleet):
    hub, engine, receiver, audit = fleet
    receiver.shutdown()
    receiver.server_close()
    for _ in range(5):
        _stream(hub.url, {})

    def dropped() -> float:
        text = httpx.get(hub.url + "/metrics", timeout=10).text
        m = re.search(r"^appliance_spans_dropped_total (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0
    wait_until(lambda: dropped() >= 5, 60, "the hub's dropped spans counted")
    lines = [json.loads(x) for x in audit.read_text().splitlines() if '"request"' in x]
    assert len(lines) == 5 and all(x["status"] == 200 for x in lines)
