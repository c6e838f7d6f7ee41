"""`Hub__Workers=2`: a request relayed by the worker is the main process's, whole-hub.

A real hub with one worker and a real `sim` node. Which process accepts a connection is
the kernel's choice, so the test opens fresh connections until one is owned by the worker
(read off /proc: the server side of the connection is a socket in the worker's fd table),
sends an inference request and a GET /api/status on it, and checks that the request shows
exactly once in the main process's audit log, /metrics and /api/status. Then a stream cut
by the client frees its place (in_flight back to 0), and the worker exits with the hub.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procfs import children, client_port, server_inode, socket_inodes

pytestmark = pytest.mark.e2e

TOKEN, ADMIN, MODEL = "node-secret", "admin-secret", "sim-small"


def test_request_through_a_worker_counts_once_in_the_main(procs, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN, admin=ADMIN)
    audit = Path(f.audit_path)
    hub = f.start_hub({"Audit__Path": f.audit_path, "Models__0__Name": MODEL,
                       "Models__0__Replicas": "1", "Hub__Workers": "2"})
    f.start_node("gpu-a", {"Node__MemoryMb": "4000", "Node__AnnounceSeconds": "1",
                           "Sim__TokensPerSecond": "50"})
    f.wait(lambda: len(children(hub.pid)) == 1, "one worker started")
    worker = children(hub.pid)[0]
    f.wait(lambda: f.ready_on(MODEL), "sim-small ready")
    port = int(hub.url.rsplit(":", 1)[1])

    on_worker = None
    for _ in range(200):
        c = httpx.Client(base_url=hub.url, timeout=30)
        inode = server_inode(port, client_port(c))
        if inode and inode in socket_inodes(worker):
            on_worker = c
            break
        c.close()
    assert on_worker is not None, "no connection was accepted by the worker in 200 tries"
    before = audit.read_text().count('"kind": "request"') if audit.exists() else 0

    r = on_worker.post("/v1/chat/completions", headers={"x-request-id": "via-worker"},
                       json={"model": MODEL, "max_tokens": 3,
                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "via-worker"
    # Status through the same (worker's) connection is the main process's answer.
    st = on_worker.get("/api/status", headers=f.admin_headers())
    assert st.status_code == 200
    assert inode in socket_inodes(worker)  # still the worker's connection

    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    mine = [x for x in lines if x.get("request_id") == "via-worker"]
    assert len(mine) == 1 and mine[0]["status"] == 200 and mine[0]["node"] == "gpu-a", mine
    assert sum(1 for x in lines if x.get("kind") == "request") == before + 1
    count = [ln for ln in f.scrape().splitlines() if ln.startswith("appliance_requests_total{")
             and f'model="{MODEL}"' in ln and 'status="200"' in ln]
    assert len(count) == 1 and float(count[0].rsplit(" ", 1)[1]) == 1.0, count
    # the place is given back just after the last byte (as with one process)
    f.wait(lambda: f.nodes()["gpu-a"]["in_flight"] == 0, "the place given back")
    # What the engine said of its prompt cache comes back with the worker's Done: the
    # second of two long prompts is counted cached in the main process.
    for _ in range(2):
        r = on_worker.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 3,
            "messages": [{"role": "user", "content": "the same long prompt " * 40}]})
        assert r.status_code == 200
    routing = f.models()[MODEL]["routing"]
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and routing["cached_prompt_tokens"] == cached

    # A stream the client abandons gives its place back in the main process.
    with on_worker.stream("POST", "/v1/chat/completions",
                          json={"model": MODEL, "max_tokens": 500, "stream": True,
                                "messages": [{"role": "user", "content": "long"}]}) as s:
        assert s.status_code == 200
        chunks = s.iter_raw()  # held: a dropped iterator closes the response
        assert next(chunks)
        assert f.nodes()["gpu-a"]["in_flight"] == 1
    on_worker.close()
    f.wait(lambda: '"client_disconnected"' in audit.read_text(), "the 499's audit line")
    f.wait(lambda: f.nodes()["gpu-a"]["in_flight"] == 0, "the abandoned stream's place given back")

    assert f.stop(hub) == 0
    f.wait(lambda: not os.path.exists(f"/proc/{worker}") or
           open(f"/proc/{worker}/stat").read().split()[2] == "Z", "the worker gone")
