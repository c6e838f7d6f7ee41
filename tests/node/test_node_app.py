"""The node's ASGI app in-process: a fake engine in front of a tiny upstream, real sockets
on 127.0.0.1:0, no sleeps -- every wait is for a line, a change or an event, bounded."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from urllib.parse import quote

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry

from appliance.config import load
from appliance.http.asgi import read_body
from appliance.http.stream import wait_disconnect
from appliance.node.app import NodeApp
from appliance.node.engines.base import Engine, EngineError
from appliance.node.metrics import NodeMetrics
from appliance.node.state import NodeStateKeeper
from appliance.server.serve import serve
from appliance.wire import EngineInstall, Heartbeat, ModelState, StateEvent, watch_decoder

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Upstream:
    """An engine stand-in: SSE on /v1/chat/completions, NDJSON on /api/chat. While `gate`
    is unset a stream stops after its first chunk."""

    def __init__(self) -> None:
        self.gate = trio.Event()
        self.gate.set()
        self.seen: list[tuple[str, bytes, dict]] = []
        self.arrived = trio.Event()
        self.gone = 0
        self.on_gone: Callable[[], None] = lambda: None

    async def __call__(self, scope, receive, send):
        body = await read_body(receive, 1 << 20)
        self.seen.append((scope["path"], body, dict((k.decode(), v.decode()) for k,
                                                    v in scope["headers"])))
        self.arrived.set()
        if scope["path"] == "/v1/teapot":
            await send({"type": "http.response.start", "status": 418,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"error":"short and stout"}'})
            return
        sse = scope["path"] == "/v1/chat/completions"
        ct = b"text/event-stream" if sse else b"application/x-ndjson"
        chunks = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n"] if sse else \
                 [b'{"n":1}\n', b'{"n":2,"done":true}\n']
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type",
                                                                               ct)]})
        await send({"type": "http.response.body", "body": chunks[0], "more_body": True})
        async with trio.open_nursery() as n:
            async def disconnected():
                await wait_disconnect(receive)
                self.gone += 1
                self.on_gone()
                n.cancel_scope.cancel()
            n.start_soon(disconnected)
            await self.gate.wait()
            for c in chunks[1:]:
                await send({"type": "http.response.body", "body": c, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            n.cancel_scope.cancel()


class FakeEngine(Engine):
    kind = "fake"

    def __init__(self, url: str, on_change) -> None:
        super().__init__(on_change)
        self.url = url
        self._models = {n: ModelState(n, size_mb=500) for n in ("sim-small", "qwen2.5:0.5b",
                                                                "org/model:q4", "broken")}
        self._models["sim-small"].state = "ready"
        self.loads: list[tuple[str, str, str]] = []
        self.hang: set[str] = set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED):
        task_status.started()
        await trio.sleep_forever()

    def installs(self):
        return [EngineInstall("fake", "0.1")]

    def models(self):
        return list(self._models.values())

    async def load(self, model, source="", args=""):
        self.loads.append((model, source, args))
        if model in self.hang:
            await trio.sleep_forever()
        if model == "broken":
            raise EngineError("unknown model architecture: 'kev'")
        self._models.setdefault(model, ModelState(model)).state = "ready"
        self.on_change()

    async def unload(self, model):
        if model in self._models:
            self._models[model].state = "available"
            self.on_change()

    def upstream(self, model):
        m = self._models.get(model)
        return self.url if m is not None and m.state == "ready" else None


class CountedKeeper(NodeStateKeeper):
    """The node's keeper, telling `on_count` of each request it counts in or out (the node
    publishes in-flight counts only with its heartbeats, no change is said for them)."""

    on_count: Callable[[], None] = staticmethod(lambda: None)

    def try_start(self, model: str) -> None:
        super().try_start(model)
        self.on_count()

    def finish(self, model: str) -> None:
        super().finish(model)
        self.on_count()


class Node:
    def __init__(self, url, keeper, engine, upstream, metrics):
        self.url, self.keeper, self.engine, self.upstream, self.metrics = url, keeper, engine, upstream, metrics
        self.http = httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10)
        self._changed = trio.Event()
        keeper.add_listener(self._wake)
        keeper.on_count = upstream.on_gone = self._wake

    def _wake(self) -> None:
        self._changed.set()

    async def wait_until(self, pred):
        """Until `pred()` holds: looked at again on each change of the node's state, of
        its in-flight counts and of the engine's hang-ups; bounded."""
        with trio.fail_after(5):
            while True:
                self._changed = trio.Event()
                if pred():
                    return
                await self._changed.wait()


@asynccontextmanager
async def running_node(**env):
    environ = {"Auth__NodeToken": TOKEN, "Node__Name": "gpu-a", "Node__HeartbeatSeconds": "0.1",
               **env}
    cfg = load(environ)
    up = Upstream()
    async with trio.open_nursery() as nursery:
        uhost, uport = await nursery.start(partial(serve, up, "127.0.0.1:0", "sim"))
        engine = FakeEngine(f"http://{uhost}:{uport}", lambda: keeper.changed())
        keeper = CountedKeeper("gpu-a", cfg.node, engine)
        metrics = NodeMetrics(CollectorRegistry(), keeper)
        app = NodeApp(cfg, keeper, engine, metrics)
        host, port = await nursery.start(partial(serve, app, "127.0.0.1:0", "node"))
        node = Node(f"http://{host}:{port}", keeper, engine, up, metrics)
        async with node.http:
            yield node
        await app.aclose()
        nursery.cancel_scope.cancel()


async def test_auth_required_everywhere_but_health():
    async with running_node() as n:
        async with httpx.AsyncClient(base_url=n.url) as anon:
            r = await anon.get("/node/v1/state")
            assert r.status_code == 401 and "node token" in r.json()["error"]
            r = await anon.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await anon.post("/api/chat", json=CHAT)
            assert r.status_code == 401 and isinstance(r.json()["error"], str)
            r = await anon.get("/node/v1/state", headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert (await anon.get("/health")).status_code == 200
        r = await n.http.get("/node/v1/state")
        assert r.status_code == 200
        st = r.json()
        assert st["name"] == "gpu-a" and st["engines"] == [{"kind": "fake", "version": "0.1"}]


async def test_watch_full_state_first_then_heartbeats_and_changes():
    async with running_node() as n:
        async with n.http.stream("GET", "/node/v1/watch") as r:
            assert r.status_code == 200
            assert r.headers["content-type"] == "application/x-ndjson"
            lines = r.aiter_lines()
            with trio.fail_after(5):
                first = watch_decoder.decode(await lines.__anext__())
                assert isinstance(first, StateEvent)
                assert first.state.name == "gpu-a" and first.state.model(
                    "sim-small").state == "ready"
                beats = 0
                while beats < 2:
                    ev = watch_decoder.decode(await lines.__anext__())
                    assert isinstance(ev, Heartbeat) and ev.ts > 0
                    beats += 1
                assert (await n.http.post("/node/v1/pause")).json()["paused"] is True
                ev = watch_decoder.decode(await lines.__anext__())
                while isinstance(ev, Heartbeat):
                    ev = watch_decoder.decode(await lines.__anext__())
                assert ev.state.paused is True
        # The stream's end frees the handler: draining ends every watch at once.
        async with n.http.stream("GET", "/node/v1/watch") as r:
            with trio.fail_after(5):
                lines = r.aiter_lines()
                await lines.__anext__()
                n.keeper.drain()
                rest = [line async for line in lines]
        assert all(isinstance(watch_decoder.decode(x), (StateEvent, Heartbeat)) for x in rest)


async def test_pause_leave_refuse_with_503_in_api_shape():
    async with running_node() as n:
        assert (await n.http.post("/node/v1/pause")).status_code == 200
        r = await n.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()[
            "error"]["code"] == "no_capacity" and "paused" in r.json()["error"]["message"]
        r = await n.http.post("/api/chat", json=CHAT)
        assert r.status_code == 503 and "paused" in r.json()["error"]
        st = (await n.http.get("/node/v1/state")).json()
        assert st["paused"] is True
        await n.http.post("/node/v1/resume")
        r = await n.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert (await n.http.post("/node/v1/leave")).json()["left"] is True
        r = await n.http.post("/api/chat", json=CHAT)
        assert r.status_code == 503 and "left" in r.json()["error"]
        assert (await n.http.post("/node/v1/join")).json()["left"] is False
        assert (await n.http.get("/node/v1/pause")).status_code == 405


@pytest.mark.parametrize("model", ["qwen2.5:0.5b", "org/model:q4"])
async def test_load_unload_percent_encoded(model):
    async with running_node() as n:
        path = f"/node/v1/models/{quote(model, safe='')}"
        r = await n.http.post(f"{path}/load", json={"source": "/models/x.gguf", "args": "-c 4096"})
        assert r.status_code == 200 and r.json() == {"model": model, "state": "ready"}
        assert n.engine.loads == [(model, "/models/x.gguf", "-c 4096")]
        assert n.keeper.snapshot().model(model).state == "ready"
        r = await n.http.post(f"{path}/unload")
        assert r.status_code == 200 and n.keeper.snapshot().model(model).state == "available"
        assert (await n.http.get(f"{path}/load")).status_code == 405


async def test_load_failure_and_timeout_published(autojump_clock):
    async with running_node(Engine__StartTimeoutSeconds="0.2") as n:
        r = await n.http.post("/node/v1/models/broken/load")
        assert r.status_code == 502 and r.json() == {"error": "unknown model architecture: 'kev'"}
        m = n.keeper.snapshot().model("broken")
        assert (m.state, m.last_error) == ("failed", "unknown model architecture: 'kev'")
        n.engine.hang.add("qwen2.5:0.5b")
        t0 = trio.current_time()
        r = await n.http.post(f"/node/v1/models/{quote('qwen2.5:0.5b', safe='')}/load")
        assert r.status_code == 504 and r.json() == {"error": "health never came in 0.2 s"}
        assert trio.current_time() - t0 == pytest.approx(0.2)  # Engine__StartTimeoutSeconds
        assert n.keeper.snapshot().model("qwen2.5:0.5b").state == "failed"
        r = await n.http.post("/node/v1/models/broken/load", content=b"{nope")
        assert r.status_code == 400


async def test_proxy_streams_bytes_and_counts_in_flight():
    async with running_node() as n:
        n.upstream.gate = trio.Event()
        async with n.http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            chunks = r.aiter_raw()
            with trio.fail_after(5):
                # The first chunk arrives while the engine still holds the rest: no buffering.
                assert await chunks.__anext__() == b'data: {"n":1}\n\n'
            st = n.keeper.snapshot()
            assert st.in_flight == 1 and st.model("sim-small").in_flight == 1
            n.upstream.gate.set()
            rest = b"".join([c async for c in chunks])
        assert rest == b'data: {"n":2}\n\ndata: [DONE]\n\n'
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        path, body, headers = n.upstream.seen[-1]
        assert path == "/v1/chat/completions" and json.loads(body) == CHAT
        assert "authorization" not in headers  # the node token stays on the node
        r = await n.http.post("/api/chat", json=CHAT)
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        assert r.content == b'{"n":1}\n{"n":2,"done":true}\n'
        r = await n.http.post("/v1/teapot", json=CHAT)
        assert r.status_code == 418 and r.json() == {"error": "short and stout"}
        scrape = (await n.http.get("/metrics")).text
        assert 'appliance_node_requests_total{model="sim-small",status="200"} 2.0' in scrape
        assert 'appliance_node_in_flight{model="sim-small"} 0.0' in scrape


async def test_max_concurrency_enforced():
    async with running_node(Node__MaxConcurrency="1") as n:
        n.upstream.gate = trio.Event()
        async with n.http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            chunks = r.aiter_raw()
            with trio.fail_after(5):
                await chunks.__anext__()
            r2 = await n.http.post("/v1/chat/completions", json=CHAT)
            assert r2.status_code == 503 and r2.json()["error"]["code"] == "no_capacity"
            assert "Node__MaxConcurrency 1" in r2.json()["error"]["message"]
            n.upstream.gate.set()
            async for _ in chunks:
                pass
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        assert (await n.http.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def test_an_engine_silent_mid_stream_is_ended_by_the_read_deadline(autojump_clock):
    # Node__UpstreamReadSeconds bounds every read of a relayed stream (relay_body keeps it
    # lazily, one scope per relay): the engine sends a token, then nothing.
    async with running_node(Node__UpstreamReadSeconds="0.5") as n:
        n.upstream.gate = trio.Event()  # never set
        with trio.fail_after(10):
            r = await n.http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        first, _, rest = r.content.partition(b"\n\n")
        assert first == b'data: {"n":1}'
        error = json.loads(rest.removeprefix(b"data: "))["error"]
        assert error["code"] == "engine_error" and "sent nothing for 0.5 s" in error["message"]
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        scrape = (await n.http.get("/metrics")).text
        assert 'appliance_node_requests_total{model="sim-small",status="engine_error"} 1.0' in scrape


async def test_client_disconnect_frees_the_place_and_cancels_upstream():
    async with running_node(Node__MaxConcurrency="1") as n:
        n.upstream.gate = trio.Event()
        async with n.http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
            with trio.fail_after(5):
                await r.aiter_raw().__anext__()
            assert n.keeper.in_flight_total == 1
        # Closing the half-read response drops the connection.
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        await n.wait_until(lambda: n.upstream.gone > 0)
        scrape = (await n.http.get("/metrics")).text
        assert 'appliance_node_requests_total{model="sim-small",status="client_gone"} 1.0' in scrape


async def test_errors_in_the_right_shape():
    async with running_node(Hub__MaxBodyBytes="1000") as n:
        r = await n.http.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = await n.http.post("/api/chat", content=b'{"messages": []}')
        assert r.status_code == 400 and "model" in r.json()["error"]
        r = await n.http.post("/v1/chat/completions", content=b"[1, 2]")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await n.http.post("/v1/chat/completions", json={"model": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await n.http.post("/v1/chat/completions", json={"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await n.http.post("/v1/chat/completions", json={"model": "qwen2.5:0.5b"})
        assert r.status_code == 503 and "not loaded" in r.json()["error"]["message"]
        assert (await n.http.get("/nowhere")).status_code == 404
        assert (await n.http.get("/node/v1/nowhere")).status_code == 404
        r = await n.http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        r = await n.http.delete("/api/chat")
        assert r.status_code == 405 and isinstance(r.json()["error"], str)
        assert n.keeper.in_flight_total == 0


async def test_listings_from_state():
    async with running_node() as n:
        ids = [m["id"] for m in (await n.http.get("/v1/models")).json()["data"]]
        assert "sim-small" in ids and "org/model:q4" in ids
        ps = (await n.http.get("/api/ps")).json()["models"]
        assert [m["name"] for m in ps] == ["sim-small"]
        tags = (await n.http.get("/api/tags")).json()["models"]
        assert {m["name"] for m in tags} >= {"sim-small", "qwen2.5:0.5b"}
        assert "version" in (await n.http.get("/api/version")).json()


# --- the process's parts: announcer, advertise URL, reloads -------------------------------

async def test_announce_repeats_and_logs_once_per_outage(autojump_clock, caplog):
    from appliance.node.announce import announce_loop
    from appliance.wire import Announce

    calls, hub_up = [], [False]

    def handler(req: httpx.Request) -> httpx.Response:
        calls.append((trio.current_time(), str(req.url), req.headers["authorization"],
                      json.loads(req.content)))
        if not hub_up[0]:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(204)

    caplog.set_level("INFO", logger="appliance.node.announce")
    start = trio.current_time()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        async with trio.open_nursery() as n:
            await n.start(announce_loop, c, "http://hub:8080/", "tok",
                          Announce("gpu-a", "http://gpu-a:9090"), 15.0)
            await trio.sleep(31)
            hub_up[0] = True
            await trio.sleep(15)
            n.cancel_scope.cancel()
    assert [t - start for t, *_ in calls] == [0, 15, 30, 45]
    assert calls[0][1:] == ("http://hub:8080/api/nodes/announce", "Bearer tok",
                            {"name": "gpu-a", "url": "http://gpu-a:9090"})
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "connection refused" in warned[0].getMessage()
    assert sum("announced gpu-a" in r.getMessage() for r in caplog.records) == 1


def test_advertise_url():
    import socket

    from appliance.node.run import advertise_url

    assert advertise_url(load({}), "0.0.0.0", 9090) == f"http://{socket.gethostname()}:9090"
    assert advertise_url(load({}), "127.0.0.1", 5) == "http://127.0.0.1:5"
    assert advertise_url(load({}), "::1", 5) == "http://[::1]:5"
    assert advertise_url(load({"Node__AdvertiseUrl": "https://gpu-a.lan:9090/"}), "0.0.0.0",
                         1) == "https://gpu-a.lan:9090"


async def test_reload_applies_limits_and_publishes():
    from appliance.node.run import apply_reloads

    async with running_node(Node__MaxConcurrency="2") as n:
        send, recv = trio.open_memory_channel(1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(apply_reloads, n.keeper, n.engine, recv)
            await send.send(load({"Node__MaxConcurrency": "1", "Node__MemoryMb": "8000"}))
            await n.wait_until(lambda: n.keeper.max_concurrency == 1)
            st = (await n.http.get("/node/v1/state")).json()
            assert st["max_concurrency"] == 1 and st["memory_total_mb"] == 8000
            await send.aclose()


async def test_run_node_in_process_sim_then_stop_drains():
    """run_node as `appliance up` uses it: started with the bound address, stopped by an
    event (no signals), the watch stream ends at once, the call returns."""
    from appliance.node.run import run_node

    cfg = load({"Engine__Kind": "sim", "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Node__Name": "local", "Auth__NodeToken": TOKEN, "Hub__DrainSeconds": "5"})
    stop = trio.Event()
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(run_node, cfg, stop)
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}", headers=AUTH,
                                         timeout=10) as c:
                assert (await c.get("/node/v1/state")).json()["name"] == "local"
                async with c.stream("GET", "/node/v1/watch") as w:
                    lines = w.aiter_lines()
                    first = watch_decoder.decode(await lines.__anext__())
                    assert first.state.engines[0].kind == "sim"
                    stop.set()
                    async for _ in lines:
                        pass


async def test_fencing_refuses_an_older_epoch_with_stale_leader():
    """HA: the highest epoch seen wins; an older leader's load/unload is refused (409)."""
    async with running_node() as n:
        path = f"/node/v1/models/{quote('m', safe='')}"
        assert (await n.http.post(f"{path}/load",
                                  headers={"x-appliance-epoch": "7"})).status_code == 200
        r = await n.http.post(f"{path}/unload", headers={"x-appliance-epoch": "5"})
        assert r.status_code == 409 and r.json()[
            "code"] == "stale_leader" and "older than 7" in r.json()["error"]
        r = await n.http.post(f"{path}/load", headers={"x-appliance-epoch": "x"})
        assert r.status_code == 409 and r.json()["code"] == "stale_leader"
        assert n.engine.loads == [("m", "", "")]  # neither refused call reached the engine
        assert (await n.http.post(f"{path}/unload",
                                  headers={"x-appliance-epoch": "9"})).status_code == 200
        assert (await n.http.post(f"{path}/load",
                                  headers={"x-appliance-epoch": "7"})).status_code == 409
        assert (await n.http.post(f"{path}/load")).status_code == 200  # one hub alone sends none


WHOLE = {"x-appliance-whole": "600"}  # the hub's read bound, Hub__UpstreamReadSeconds


async def test_a_stream_the_hub_only_assembles_comes_in_one_body():
    # The hub says it only assembles the answer (x-appliance-whole): the engine's stream,
    # its bytes unchanged, comes in one body with its length -- not event by event.
    async with running_node() as n:
        r = await n.http.post("/v1/chat/completions", json=CHAT, headers=WHOLE)
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        assert r.content == b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
        assert r.headers["content-length"] == str(len(r.content))
        assert "transfer-encoding" not in r.headers
        # Not asked, or not an event stream (Ollama's NDJSON): relayed as it comes.
        r = await n.http.post("/v1/chat/completions", json=CHAT)
        assert r.headers.get("transfer-encoding") == "chunked"
        r = await n.http.post("/api/chat", json=CHAT, headers=WHOLE)
        assert r.headers.get("transfer-encoding") == "chunked"
        assert r.content == b'{"n":1}\n{"n":2,"done":true}\n'
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        scrape = (await n.http.get("/metrics")).text
        assert 'appliance_node_requests_total{model="sim-small",status="200"} 3.0' in scrape


async def test_a_hub_that_leaves_while_the_node_gathers_stops_the_engine():
    async with running_node() as n:
        n.upstream.gate = trio.Event()  # the engine sends one event, then holds the rest
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(n.http.post, "/v1/chat/completions", json=CHAT,
                                       headers=WHOLE))
            await n.wait_until(lambda: n.keeper.in_flight_total == 1)
            nursery.cancel_scope.cancel()  # the hub leaves: its connection closes
        await n.wait_until(lambda: n.upstream.gone > 0)  # the engine's stream was closed
        await n.wait_until(lambda: n.keeper.in_flight_total == 0)
        scrape = (await n.http.get("/metrics")).text
        assert 'appliance_node_requests_total{model="sim-small",status="client_gone"} 1.0' in scrape


async def test_a_hub_that_names_no_read_bound_gets_the_stream_as_it_comes():
    async with running_node() as n:
        for bad in ("0", "-1", "nan", "inf", "soon", "1" * 17):
            r = await n.http.post("/v1/chat/completions", json=CHAT,
                                  headers={"x-appliance-whole": bad})
            assert r.headers.get("transfer-encoding") == "chunked", bad
            assert r.content == b'data: {"n":1}\n\ndata: {"n":2}\n\ndata: [DONE]\n\n'
