"""SIGHUP under `appliance up` (appliance/up.py): one process, hub and node, re-reads its
env file once and applies it to both parts -- the hub's listener and the node's take the
new Hub__MaxBufferedBytes for the next request (503 busy for a body that fitted before),
the node its new Node__MaxConcurrency, while connections kept alive from before the reload
still serve; a node setting it cannot take is named. A broken file is refused for both
parts with one line."""

from __future__ import annotations

import http.client
import json
import signal
from urllib.parse import urlsplit

import pytest

from tests.harness.fleet import Fleet, chat_body

pytestmark = pytest.mark.e2e

MODEL = "sim-small"
BIG = "x" * 20_000  # fits a 1 MB buffered-bytes bound, not a 4 KB one


def write_env(path, lines: dict[str, str]) -> None:
    path.write_text("# rewritten by the test\n" + "".join(f"{k}={v}\n" for k, v in lines.items()))


def kept(url: str) -> http.client.HTTPConnection:
    u = urlsplit(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=30)


def ask(conn: http.client.HTTPConnection, method: str, path: str,
        body: dict | None = None) -> tuple[int, dict]:
    raw = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=raw, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"{}")


def test_up_sighup_reloads_the_hub_and_the_node_listener_limits(procs, tmp_path):
    f = tmp_path / "up.env"
    write_env(f, {"Hub__MaxBufferedBytes": "1000000", "Node__MaxConcurrency": "2"})
    up = Fleet(procs=procs).start("up", {
        "Hub__Listen": "127.0.0.1:0", "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
        "Sim__TokensPerSecond": "0", "APPLIANCE_ENV_FILE": str(f)}, wait=("hub", "node"))
    hub_c, node_c = kept(up.urls["hub"]), kept(up.urls["node"])
    assert ask(hub_c, "POST", "/v1/chat/completions", chat_body(MODEL, BIG, max_tokens=4))[0] == 200
    status, state = ask(node_c, "GET", "/node/v1/state")
    assert status == 200 and state["max_concurrency"] == 2
    assert ask(node_c, "POST", "/v1/chat/completions", chat_body(MODEL, BIG, max_tokens=4))[0] == 200
    hub_sock, node_sock = hub_c.sock, node_c.sock

    write_env(f, {"Hub__MaxBufferedBytes": "4096", "Node__MaxConcurrency": "5",
                  "Node__DrainSeconds": "3"})
    up.signal(signal.SIGHUP)
    up.wait_stderr(r"configuration reloaded from .*up\.env")
    # What the running node part cannot take is named, not silently kept.
    up.wait_stderr(r"node part: changed, applied only at the next start: Node__DrainSeconds$")
    up.wait_stderr(r"configuration reloaded: Node__MaxConcurrency 2 -> 5; listener limits now "
                   r".*Hub__MaxBufferedBytes=4096")

    for url in (up.urls["hub"], up.urls["node"]):  # a new connection: the new bound
        status, body = ask(kept(url), "POST", "/v1/chat/completions", chat_body(MODEL, BIG, max_tokens=4))
        assert status == 503 and body["error"]["code"] == "busy", (url, body)
    # The connections kept alive from before still serve, on the same sockets.
    assert ask(hub_c, "POST", "/v1/chat/completions", chat_body(MODEL, "small", max_tokens=4))[0] == 200
    status, state = ask(node_c, "GET", "/node/v1/state")
    assert status == 200 and state["max_concurrency"] == 5
    assert hub_c.sock is hub_sock and node_c.sock is node_sock
    # ... and their next big body meets the new bound too.
    status, body = ask(node_c, "POST", "/v1/chat/completions", chat_body(MODEL, BIG, max_tokens=4))
    assert status == 503 and body["error"]["code"] == "busy"

    # A broken file: refused once for the whole process; both parts keep what they had.
    write_env(f, {"Hub__MaxBufferedBytes": "-1", "Node__MaxConcurrency": "7"})
    up.signal(signal.SIGHUP)
    up.wait_stderr(r"reload refused, keeping the old configuration: .*Hub__MaxBufferedBytes")
    status, state = ask(kept(up.urls["node"]), "GET", "/node/v1/state")
    assert status == 200 and state["max_concurrency"] == 5
    assert sum("configuration reloaded: " in x for x in up.stderr_lines) == 1
    assert not [x for x in up.stderr_lines if "Traceback" in x]
    up.signal(signal.SIGTERM)
    assert up.wait_exit(20) == 0
