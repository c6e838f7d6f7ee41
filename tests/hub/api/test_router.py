"""The hub's request path in-process: retry before the first byte, disconnect cancels
upstream, error shapes, and the lean upstream pool's reuse -- against small fake nodes
served on port 0 with the same `appliance.server.serve.serve` the real processes use."""

import json
from functools import partial

import httpx
import trio

from appliance.config import load
from appliance.http.asgi import read_body
from appliance.http.errors import ApiError, error_body
from appliance.http.stream import wait_disconnect
from appliance.hub.api.router import allowed, authenticate, decode_request
from appliance.hub.run import run_hub
from appliance.server.serve import serve
from appliance.wire import ModelState, NodeState
from tests.harness.procs import free_port


class FakeNode:
    """Answers inference with a streamed body; records what it saw and when it was cancelled."""

    def __init__(self, name: str, chunks: int = 3, pause: float = 0.0) -> None:
        self.name = name
        self.chunks = chunks
        self.pause = pause
        self.requests: list[dict] = []
        self.cancelled = trio.Event()
        self.connections: set = set()

    async def __call__(self, scope, receive, send):
        body = await read_body(receive, 1 << 20)
        self.requests.append({"path": scope["path"], "body": body,
                              "headers": dict(scope["headers"])})
        self.connections.add(scope["client"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        async with trio.open_nursery() as nursery:
            async def watch():
                # As the real node does: the hub hanging up stops the generation.
                await wait_disconnect(receive)
                self.cancelled.set()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            for i in range(self.chunks):
                await send({"type": "http.response.body",
                            "body": f"data: {self.name}-{i}\n\n".encode(), "more_body": True})
                await trio.sleep(self.pause)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            nursery.cancel_scope.cancel()


def _ready(h, model="m"):
    h.connected = True
    h.state = NodeState(name=h.name, slots=4, models=[ModelState(name=model, state="ready")])


async def _hub(nursery, env=None):
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Audit__Path": "/dev/null",
                **(env or {})})
    stop = trio.Event()
    hub, (host, port) = await nursery.start(run_hub, cfg, stop)
    return hub, f"http://{host}:{port}", stop


def _static(hub, name, url):
    """A node the hub knows without a supervisor (the test sets its state)."""
    h, _ = hub.registry.upsert(name, url, static=True)
    _ready(h)
    return h


async def test_failed_node_before_first_byte_is_retried_on_another():
    good = FakeNode("good")
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, good, "127.0.0.1:0", "fake"))
        hub, url, stop = await _hub(nursery)
        dead = _static(hub, "dead", f"http://127.0.0.1:{free_port()}")
        dead.state.slots = 8  # the most free places: picked first
        _static(hub, "good", f"http://{host}:{port}")
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(url + "/v1/chat/completions", json={"model": "m", "stream": True})
        assert r.status_code == 200
        assert "good-0" in r.text and r.text.endswith("data: [DONE]\n\n")
        # The node got the client's body with the stream's usage asked for, plus the node token
        # header, not the client's key.
        assert json.loads(good.requests[0]["body"]) == {"model": "m", "stream": True,
                                                        "stream_options": {"include_usage": True}}
        with trio.fail_after(5):
            while hub.registry.nodes["good"].in_flight_total:
                await hub.registry.wait_changed()
        assert hub.registry.nodes["dead"].in_flight_total == 0
        nursery.cancel_scope.cancel()


async def test_every_node_failing_is_no_capacity_with_retry_after():
    async with trio.open_nursery() as nursery:
        hub, url, stop = await _hub(nursery)
        _static(hub, "d1", f"http://127.0.0.1:{free_port()}")
        _static(hub, "d2", f"http://127.0.0.1:{free_port()}")
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(url + "/v1/chat/completions", json={"model": "m"})
            r2 = await c.post(url + "/api/chat", json={"model": "m"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        assert int(r.headers["retry-after"]) >= 1
        assert r2.status_code == 503 and "no node can serve" in r2.json()["error"]
        nursery.cancel_scope.cancel()


async def test_client_disconnect_cancels_upstream_and_frees_the_place():
    slow = FakeNode("slow", chunks=1000, pause=0.05)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, slow, "127.0.0.1:0", "fake"))
        hub, url, stop = await _hub(nursery)
        h = _static(hub, "slow", f"http://{host}:{port}")
        async with httpx.AsyncClient(timeout=10) as c:
            async with c.stream("POST", url + "/v1/chat/completions", json={"model": "m",
                                                                            "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: slow-2"):
                        assert h.in_flight_total == 1
                        break
        with trio.fail_after(5):
            await slow.cancelled.wait()
        with trio.fail_after(5):
            while h.in_flight_total:
                await hub.registry.wait_changed()
        nursery.cancel_scope.cancel()


async def test_kept_connections_are_reused():
    good = FakeNode("good", chunks=1)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, good, "127.0.0.1:0", "fake"))
        hub, url, stop = await _hub(nursery)
        _static(hub, "good", f"http://{host}:{port}")
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(5):
                r = await c.post(url + "/v1/completions", json={"model": "m"})
                assert r.status_code == 200
        assert len(good.requests) == 5
        assert len(good.connections) == 1  # one kept-alive connection served all five
        nursery.cancel_scope.cancel()


def test_authenticate_allowed_and_decode():
    cfg = load({"Auth__RequireKeys": "true", "Auth__Clients__0__Name": "ops",
                "Auth__Clients__0__Key": "k1",
                "Auth__Clients__0__Models": "llama*,qwen2.5:0.5b"})
    c = authenticate(cfg.auth, "k1")
    assert c.name == "ops"
    assert allowed(c, "llama3:8b") and allowed(c, "qwen2.5:0.5b") and not allowed(c, "phi-4")
    for key in (None, "", "k2"):
        try:
            authenticate(cfg.auth, key)
        except ApiError as e:
            assert e.status == 401 and e.code == "invalid_api_key"
        else:
            raise AssertionError("no 401")
    assert decode_request(b'{"model": "m", "stream": true, "messages": []}').stream is True
    deep = b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for body, code in ((b"{", "invalid_json"), (b"[]", "invalid_request"), (b"{}",
                                                                            "invalid_request"),
                       (b'{"model": 3}', "invalid_request"), (deep, "invalid_json")):
        try:
            decode_request(body)
        except ApiError as e:
            assert e.status == 400 and e.code == code
        else:
            raise AssertionError(body)


def test_error_shapes():
    o = json.loads(error_body("openai", 503, "model_parked", "parked: boom"))
    assert o == {"error": {"message": "parked: boom", "type": "service_unavailable", "param": None,
                           "code": "model_parked"}}
    assert json.loads(error_body("ollama", 404, "model_not_found",
                                 "model 'x' not found")) == {"error": "model 'x' not found"}
    e = ApiError(503, "model_loading", "loading; retry shortly", retry_after=2.4)
    assert e.headers() == [(b"retry-after", b"2")]
    # Refusals a retry cannot cure say so, and carry no Retry-After (DESIGN 9.1).
    assert ApiError(503, "model_parked", "x").headers() == [(b"x-should-retry", b"false")]
    assert ApiError(503, "model_unplaceable", "x", retry_after=5).headers() == [(b"x-should-retry",
                                                                                 b"false")]
