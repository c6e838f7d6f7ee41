"""The hub's request path when things go wrong, in-process against small fake nodes: a
node declared lost ends its streams at once (in each API's framing, read by the real
`openai` and `ollama` clients) and its unanswered requests go elsewhere; the drain
deadline ends streams with `shutting_down`; every request gets exactly one audit line
and one count (malformed, client gone mid-body, node lost, drained)."""

import json
from functools import partial
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import trio

from appliance.config import load
from appliance.http.asgi import read_body
from appliance.http.stream import wait_disconnect
from appliance.hub.run import run_hub
from appliance.server.serve import serve
from appliance.wire import ModelState, NodeState


class StallNode:
    """Streams `chunks` lines in the API's framing, then stalls (a SIGSTOPped node, as the
    hub sees it); with `answer=False` it never even answers."""

    def __init__(self, name: str, chunks: int = 2, answer: bool = True) -> None:
        self.name = name
        self.chunks = chunks
        self.answer = answer
        self.got = trio.Event()

    async def __call__(self, scope, receive, send):
        await read_body(receive, 1 << 20)
        self.got.set()
        async with trio.open_nursery() as nursery:
            async def watch():
                await wait_disconnect(receive)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            if not self.answer:
                await trio.sleep_forever()
            ndjson = scope["path"].startswith("/api/")
            ctype = b"application/x-ndjson" if ndjson else b"text/event-stream"
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type",
                                                                                   ctype)]})
            for i in range(self.chunks):
                if ndjson:
                    line = {"model": "m", "created_at": "2024-01-01T00:00:00Z",
                            "message": {"role": "assistant", "content": f"{self.name}-{i} "},
                            "done": False}
                    body = json.dumps(line).encode() + b"\n"
                else:
                    line = {"id": "c", "object": "chat.completion.chunk", "created": 0,
                            "model": "m",
                            "choices": [{"index": 0, "delta": {"content": f"{self.name}-{i} "},
                                         "finish_reason": None}]}
                    body = b"data: " + json.dumps(line).encode() + b"\n\n"
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await trio.sleep_forever()


def _ready(hub, name, url, slots=4):
    h, _ = hub.registry.upsert(name, url, static=True)
    hub.registry.apply_state(h, NodeState(name=name, slots=slots,
                                          models=[ModelState(name="m", state="ready")]))
    return h


async def _hub(nursery, tmp_path, env=None):
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Audit__Path": str(tmp_path / "audit.log"),
                **(env or {})})
    stop = trio.Event()
    hub, (host, port) = await nursery.start(run_hub, cfg, stop)
    return hub, f"http://{host}:{port}", stop


async def _fake(nursery, app):
    host, port = await nursery.start(partial(serve, app, "127.0.0.1:0", "fake"))
    return f"http://{host}:{port}"


def _requests(tmp_path) -> list[dict]:
    lines = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "request"]


def _count(hub, status: str, model: str = "m") -> float:
    return hub.metrics_registry.get_sample_value(
        "appliance_requests_total", {"client": "anonymous", "model": model,
                                     "status": status}) or 0.0


async def _when(event: trio.Event) -> None:
    with trio.fail_after(10):
        await event.wait()


async def test_lost_node_ends_openai_stream_with_node_lost_event(tmp_path):
    node = StallNode("gpu-a")
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path)
        h = _ready(hub, "gpu-a", await _fake(nursery, node))
        oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        got = []
        stream = await oc.chat.completions.create(model="m", stream=True,
                                                  messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.APIError) as e:
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)
                if len(got) == 2:
                    hub.registry.mark_lost(h, "no heartbeat for 6 s")
        assert got == ["gpu-a-0 ", "gpu-a-1 "]
        assert "gpu-a" in e.value.message and "lost" in e.value.message
        assert e.value.body["code"] == "node_lost"
        (line,) = _requests(tmp_path)
        assert line["status"] == 200 and line["error"] == "node_lost" and line["node"] == "gpu-a"
        assert _count(hub, "200") == 1
        nursery.cancel_scope.cancel()


async def test_a_node_silent_mid_stream_is_ended_by_the_hub_read_deadline(tmp_path):
    # Hub__UpstreamReadSeconds bounds every read of a relayed stream (relay_body keeps it
    # lazily): the node sends two tokens, then nothing, and is never declared lost.
    node = StallNode("gpu-a")
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path, {"Hub__UpstreamReadSeconds": "0.5"})
        _ready(hub, "gpu-a", await _fake(nursery, node))
        oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)
        got = []
        with trio.fail_after(10):
            stream = await oc.chat.completions.create(model="m", stream=True,
                                                      messages=[{"role": "user", "content": "x"}])
            with pytest.raises(openai.APIError) as e:
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content)
        assert got == ["gpu-a-0 ", "gpu-a-1 "]
        assert "sent nothing for 0.5 s" in e.value.message and "gpu-a" in e.value.message
        (line,) = _requests(tmp_path)
        assert line["status"] == 200 and line["error"] == "node_lost" and line["node"] == "gpu-a"
        nursery.cancel_scope.cancel()


async def test_lost_node_ends_ollama_stream_that_the_ollama_client_raises(tmp_path):
    node = StallNode("gpu-a")
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path)
        h = _ready(hub, "gpu-a", await _fake(nursery, node))
        oc = ollama.AsyncClient(host=url, timeout=20)
        got = []
        with pytest.raises(ollama.ResponseError) as e:
            async for part in await oc.chat(model="m", messages=[{"role": "user", "content": "x"}],
                                            stream=True):
                got.append(part.message.content)
                if len(got) == 2:
                    hub.registry.mark_lost(h, "no heartbeat for 6 s")
        assert got == ["gpu-a-0 ", "gpu-a-1 "]
        assert "gpu-a" in e.value.error and "lost" in e.value.error
        # The raw bytes: one NDJSON line per event, no blank line, a proper end.
        async with httpx.AsyncClient(timeout=20) as c:
            h2 = _ready(hub, "gpu-a", hub.registry.nodes["gpu-a"].url)
            async with c.stream("POST", url + "/api/chat", json={"model": "m"}) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if len(lines) == 2:
                        hub.registry.mark_lost(h2, "watch stream ended")
        assert len(lines) == 3 and all(x.strip() for x in lines)
        assert "lost" in json.loads(lines[-1])["error"]
        assert [x["error"] for x in _requests(tmp_path)] == ["node_lost", "node_lost"]
        nursery.cancel_scope.cancel()


async def test_request_not_yet_answered_by_a_lost_node_goes_to_another(tmp_path):
    stuck = StallNode("stuck", answer=False)
    good = StallNode("good", chunks=1)
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path)
        h = _ready(hub, "stuck", await _fake(nursery, stuck),
                   slots=8)  # most free places: first pick
        _ready(hub, "good", await _fake(nursery, good))

        async def lose_it():
            await _when(stuck.got)  # the hub waits on it for the first byte...
            hub.registry.mark_lost(h, "no heartbeat for 6 s")  # ...when it is declared lost

        nursery.start_soon(lose_it)
        async with httpx.AsyncClient(timeout=20) as c:
            async with c.stream("POST", url + "/v1/chat/completions", json={"model": "m",
                                                                            "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line:
                        break
        assert r.status_code == 200 and "good-0" in line
        assert h.in_flight_total == 0
        nursery.cancel_scope.cancel()


async def test_drain_deadline_ends_streams_with_shutting_down_and_a_proper_end(tmp_path,
                                                                              autojump_clock):
    node = StallNode("gpu-a", chunks=1)
    async with trio.open_nursery() as nursery:
        hub, url, stop = await _hub(nursery, tmp_path, {"Hub__DrainSeconds": "0.5"})
        _ready(hub, "gpu-a", await _fake(nursery, node))
        async with httpx.AsyncClient(timeout=20) as c:
            async with c.stream("POST", url + "/v1/chat/completions", json={"model": "m",
                                                                            "stream": True}) as r:
                lines = []
                async for line in r.aiter_lines():  # ends cleanly: a RemoteProtocolError otherwise
                    if line:
                        lines.append(line)
                    if len(lines) == 1:
                        stop.set()
        last = json.loads(lines[-1][len("data: "):])
        assert last["error"]["code"] == "shutting_down"
        (audit,) = _requests(tmp_path)
        assert audit["error"] == "shutting_down"
        nursery.cancel_scope.cancel()


async def test_every_request_one_audit_line_and_one_count(tmp_path, autojump_clock):
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path)
        host, port = url[len("http://"):].split(":")
        async with httpx.AsyncClient(timeout=20) as c:
            deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            r = await c.post(url + "/v1/chat/completions", content=deep)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await c.post(url + "/api/chat", content=b"{")
            assert r.status_code == 400
        # A client that sends half its body and hangs up: 499, counted and audited once.
        s = await trio.open_tcp_stream(host, int(port))
        await s.send_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
            b"1000\r\n\r\n{\"model\"")
        await trio.sleep(0.2)
        await s.aclose()
        with trio.fail_after(10):
            while len(_requests(tmp_path)) < 3:
                await trio.sleep(0.05)
        got = [(x["status"], x.get("error")) for x in _requests(tmp_path)]
        assert got == [(400, "invalid_json"), (400, "invalid_json"), (499, "client_disconnected")]
        assert _count(hub, "400", "") == 2 and _count(hub, "499", "") == 1
        nursery.cancel_scope.cancel()


def test_audit_write_failures_are_counted_and_said_once_a_minute(caplog, monkeypatch):
    from appliance.hub.observe import audit as audit_mod

    clock = [1000.0]
    monkeypatch.setattr(audit_mod.time, "monotonic", lambda: clock[0])
    log = audit_mod.AuditLog("/dev/full")  # opens fine, every flush fails: ENOSPC
    seen = []
    log.on_error = lambda: seen.append(1)
    for _ in range(3):
        log.write({"kind": "request", "client": "c", "status": 200})  # never raises
    clock[0] += 61
    log.write({"kind": "request", "client": "c", "status": 200})
    assert log.write_errors == 4 and len(seen) == 4 and "No space left" in log.last_error
    assert log.failing
    said = [r for r in caplog.records if "audit line not written" in r.getMessage()]
    assert len(said) == 2


def test_audit_path_that_cannot_be_opened_is_refused_at_start(tmp_path):
    from appliance.hub.observe.audit import check_path

    (tmp_path / "file").write_text("")
    assert check_path(str(tmp_path / "audit.log")) is None
    assert "Audit__Path" in check_path(str(tmp_path / "file" / "audit.log"))
    assert check_path("") is None
    # A missing directory is refused, not created (not even at /).
    why = check_path(str(tmp_path / "missing" / "audit.log"))
    assert why is not None and "does not exist" in why and not (tmp_path / "missing").exists()
    assert "does not exist" in (check_path("/no-such-dir-appliance/audit.log") or "")
    assert not Path("/no-such-dir-appliance").exists()


async def test_unwritable_audit_never_fails_a_request(tmp_path):
    node = StallNode("gpu-a", chunks=0)
    async with trio.open_nursery() as nursery:
        cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                    "Audit__Path": "/dev/full"})
        hub, (host, port) = await nursery.start(run_hub, cfg, trio.Event())
        url = f"http://{host}:{port}"
        _ready(hub, "gpu-a", await _fake(nursery, node))
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(url + "/v1/chat/completions", content=b"{")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
            r = await c.post(url + "/v1/chat/completions", json={"model": "nope"})
            assert r.status_code == 404
            st = (await c.get(url + "/api/status")).json()
            metrics = (await c.get(url + "/metrics")).text
            admin = (await c.get(url + "/admin/status")).json()  # what `ctl status` shows
        assert st["audit"]["write_errors"] >= 2 and "No space left" in st["audit"]["last_error"]
        assert st["audit"]["failing"] and not admin["satisfied"]
        assert any("audit lines are not being written to /dev/full" in p
                   for p in admin["problems"])
        assert "appliance_audit_write_errors_total" in metrics
        assert hub.metrics_registry.get_sample_value("appliance_audit_write_errors_total") >= 2
        nursery.cancel_scope.cancel()


async def test_a_request_right_after_start_waits_for_the_fleet_instead_of_404(tmp_path, autojump_clock):
    node = StallNode("gpu-a", chunks=1)
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path, {"Node__HeartbeatSeconds": "2"})
        node_url = await _fake(nursery, node)
        h, _ = hub.registry.upsert("gpu-a", node_url, static=True)  # known, not answered yet

        async def answers_later():
            await trio.sleep(0.5)
            hub.registry.apply_state(h, NodeState(name="gpu-a", models=[ModelState(name="m",
                                                                                   state="ready")]))

        nursery.start_soon(answers_later)
        async with httpx.AsyncClient(timeout=20) as c:
            async with c.stream("POST", url + "/api/chat", json={"model": "m"}) as r:
                assert r.status_code == 200  # not 404: the model was about to be reported
        assert hub.grace.over()
        nursery.cancel_scope.cancel()


async def test_a_node_that_hangs_up_is_logged_for_an_operator(tmp_path, caplog):
    async def closer(stream):
        await stream.receive_some(
            65536)  # read the request, then hang up: a node killed mid-request
        await stream.aclose()

    good = StallNode("good", chunks=1)
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path)
        listeners = await nursery.start(partial(trio.serve_tcp, closer, 0, host="127.0.0.1"))
        _ready(hub, "gpu-a", f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", slots=8)
        _ready(hub, "good", await _fake(nursery, good))
        async with httpx.AsyncClient(timeout=20) as c:
            async with c.stream("POST", url + "/v1/chat/completions", json={"model": "m",
                                                                            "stream": True}) as r:
                assert r.status_code == 200
        said = [r.getMessage() for r in caplog.records if r.name.startswith("appliance.hub.api.")]
        assert said == [
            "node gpu-a closed the connection before answering: request for m from anonymous "
            "retried on good"]
        nursery.cancel_scope.cancel()


def test_stream_error_framing_starts_on_its_own_line():
    from appliance.http.stream import stream_error

    sse = "text/event-stream"
    assert stream_error(sse, "openai", "node_lost", "m", b"}\n\n").startswith(b"data: {")
    assert stream_error(sse, "openai", "node_lost", "m", b"x}").startswith(b"\n\ndata: {")
    assert stream_error(sse, "anthropic", "node_lost", "m",
                        b"\n\n").startswith(b"event: error\ndata: {")
    nd = "application/x-ndjson"
    line = stream_error(nd, "ollama", "node_lost", "gone", b"}\n")
    assert line == b'{"error":"gone"}\n'  # no leading blank line: every line is JSON
    assert stream_error(nd, "ollama", "node_lost", "gone", b'{"a":') == b'\n{"error":"gone"}\n'


async def test_the_openai_client_does_not_retry_an_unplaceable_model(tmp_path):
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery, tmp_path, {"Models__0__Name": "huge",
                                                         "Models__0__MemoryMb": "90000"})
        h, _ = hub.registry.upsert("gpu-a", "http://127.0.0.1:9", static=True)
        hub.registry.apply_state(h, NodeState(name="gpu-a", memory_total_mb=8000, memory_used_mb=0,
                                              models=[ModelState(name="huge", size_mb=75000)]))
        oc = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=2, timeout=20)
        with pytest.raises(openai.APIStatusError) as e:
            await oc.chat.completions.create(model="huge", messages=[{"role": "user",
                                                                      "content": "x"}])
        assert e.value.status_code == 503 and e.value.body["code"] == "model_unplaceable"
        assert e.value.response.headers["x-should-retry"] == "false"
        assert "retry-after" not in e.value.response.headers
        assert len(_requests(tmp_path)) == 1  # one request, not three: the SDK did not retry
        nursery.cancel_scope.cancel()
