"""End to end: a real `appliance node` process with the simulated engine, as an operator
would run it -- ports from the `listening on` lines, announcements to a stand-in hub,
a chat through the node, the watch stream, the metrics listener, SIGTERM draining a
request in flight and exiting 0."""

from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from appliance.wire import StateEvent, watch_decoder
from tests.harness.fleet import Fleet

pytestmark = pytest.mark.e2e

TOKEN = "node-e2e-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class StandInHub:
    """Records `POST /api/nodes/announce` bodies and their bearer."""

    def __init__(self) -> None:
        self.announces: list[tuple[str, dict]] = []
        self.got = threading.Condition()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with hub.got:
                    hub.announces.append((self.path + " " + (self.headers.get("authorization")
                                                             or ""), json.loads(body)))
                    hub.got.notify_all()
                self.send_response(204)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, n: int, timeout: float = 30) -> None:
        with self.got:
            assert self.got.wait_for(lambda: len(self.announces) >= n, timeout), self.announces

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hub():
    h = StandInHub()
    yield h
    h.close()


def test_node_process_serves_watches_announces_and_drains(procs, hub):
    f = Fleet(procs=procs, token=TOKEN)  # the hub is the stand-in
    node = f.start_node("gpu-e2e", {
        "Metrics__Listen": "127.0.0.1:0", "Node__HeartbeatSeconds": "0.2",
        "Node__MaxConcurrency": "4", "Hub__Url": hub.url, "Node__AnnounceSeconds": "0.2",
        "Sim__TokensPerSecond": "50", "Node__DrainSeconds": "20",
    }, announce=False)
    node.wait_listening("node", "metrics")
    url = node.url
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        # Announced (twice: it repeats), with the node token and the bound address.
        hub.wait_for(2)
        where, body = hub.announces[0]
        assert where == f"/api/nodes/announce Bearer {TOKEN}"
        assert body == {"name": "gpu-e2e", "url": url}

        assert c.get("/node/v1/state", headers={"authorization": "Bearer nope"}).status_code == 401
        st = c.get("/node/v1/state").json()
        assert st["name"] == "gpu-e2e" and st["max_concurrency"] == 4
        assert [e["kind"] for e in st["engines"]] == ["sim"]

        r = c.post("/node/v1/models/sim-small/load")
        assert r.status_code == 200 and r.json() == {"model": "sim-small", "state": "ready"}

        with c.stream("GET", "/node/v1/watch") as w:
            first = watch_decoder.decode(next(w.iter_lines()))
            assert isinstance(first, StateEvent)
            assert first.state.model("sim-small").state == "ready"

        chat = {"model": "sim-small", "messages": [{"role": "user", "content": "hello"}],
                "stream": True,
                "max_tokens": 5}
        with c.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200 and r.headers[
                "content-type"].startswith("text/event-stream")
            text = "".join(r.iter_text())
        assert text.rstrip().endswith("data: [DONE]")
        r = c.post("/api/chat", json={**chat, "stream": False, "options": {"num_predict": 3}})
        assert r.status_code == 200 and r.json()["done"] is True

        scrape = httpx.get(node.urls["metrics"] + "/metrics", timeout=10).text
        assert 'appliance_node_requests_total{model="sim-small",status="200"} 2.0' in scrape

        # SIGTERM with a request in flight (40 tokens at 50/s): it finishes, then exit 0.
        slow = {**chat, "max_tokens": 40}
        with c.stream("POST", "/v1/chat/completions", json=slow) as r:
            lines = r.iter_lines()
            next(lines)
            node.signal(signal.SIGTERM)
            rest = list(lines)
        assert "data: [DONE]" in rest
    assert node.wait_exit(60) == 0
    assert any("draining" in line for line in node.stderr_lines)
