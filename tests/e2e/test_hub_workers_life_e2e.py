"""`Hub__Workers=2` over a worker's life: killed mid-stream and restarted, SIGHUP, TLS.

Real hub and `sim` node processes. As in test_hub_workers_e2e.py, which process accepted a
connection is read off /proc (the server side of the connection is a socket in the
worker's fd table); each test holds a connection the worker owns.
"""

from __future__ import annotations

import json
import os
import signal
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_hub_workers_e2e import children, client_port, server_inode, socket_inodes
from tests.harness.fleet import Fleet, chat_body
from tests.harness.pki import client_ctx, make_ca, make_cert
from tests.harness.procs import Proc, wait_until

pytestmark = pytest.mark.e2e

TOKEN, ADMIN, MODEL = "node-secret", "admin-secret", "sim-small"
ADMIN_H = {"authorization": f"Bearer {ADMIN}"}
HUB_ENV = {"Models__0__Name": MODEL, "Models__0__Replicas": "1", "Hub__Workers": "2"}
NODE_ENV = {"Node__MemoryMb": "4000", "Node__AnnounceSeconds": "1", "Sim__TokensPerSecond": "50"}


def start(procs, tmp, hub_env: dict[str, str] | None = None, *, args: list[str] = (),
          node_env: dict[str, str] | None = None, verify=True) -> tuple[Fleet, Proc]:
    """A hub of two processes (audited) and one sim node announcing to it."""
    f = Fleet(tmp, procs=procs, token=TOKEN, admin=ADMIN, verify=verify)
    hub = f.start_hub({**HUB_ENV, "Audit__Path": f.audit_path, **(hub_env or {})}, args=args)
    f.start_node("gpu-a", {**NODE_ENV, **(node_env or {})})
    return f, hub


def status(hub, **kw) -> dict:
    return httpx.get(hub.url + "/api/status", headers=ADMIN_H, timeout=10, **kw).json()


def ready(hub, **kw) -> None:
    wait_until(lambda: any(m["name"] == MODEL and m["nodes"] for m in status(hub, **kw)["models"]),
               timeout=30, what="sim-small ready")


def the_worker(hub) -> int:
    """The one live worker's pid (a restarted one: a new pid)."""
    kids = wait_until(lambda: children(hub.pid), what="a worker")
    assert len(kids) == 1, kids
    return kids[0]


def connect_to(hub, worker: int, **kw) -> httpx.Client:
    """A client whose (kept) connection the worker accepted."""
    port = int(hub.url.rsplit(":", 1)[1])
    for _ in range(200):
        c = httpx.Client(base_url=hub.url, timeout=30, **kw)
        inode = server_inode(port, client_port(c))
        if inode and inode in socket_inodes(worker):
            return c
        c.close()
    raise AssertionError("no connection was accepted by the worker in 200 tries")


def metric(hub, name: str) -> float:
    scrape = httpx.get(hub.urls["metrics"] + "/metrics", timeout=10).text
    found = [ln for ln in scrape.splitlines() if ln.split(" ")[0] == name]
    assert len(found) == 1, (name, found)
    return float(found[0].rsplit(" ", 1)[1])


def test_a_worker_killed_mid_stream_is_restarted_and_its_place_given_back(procs, tmp_path):
    f, hub = start(procs, tmp_path)
    audit = Path(f.audit_path)
    worker = the_worker(hub)
    ready(hub)
    assert status(hub)["workers"]["alive"] == 2 and metric(hub, "appliance_hub_workers") == 2

    c = connect_to(hub, worker)
    with c.stream("POST", "/v1/chat/completions", headers={"x-request-id": "killed"},
                  json=chat_body(MODEL, max_tokens=500, stream=True)) as s:
        assert s.status_code == 200
        chunks = s.iter_raw()
        assert next(chunks)
        assert status(hub)["nodes"][0]["in_flight"] == 1
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):
            for _ in chunks:  # the stream ends without its last chunk
                pass
    c.close()

    # The main gave the place back and wrote the request's one audit line.
    wait_until(lambda: status(hub)["nodes"][0]["in_flight"] == 0, what="the place given back")
    wait_until(lambda: '"killed"' in audit.read_text(), what="the killed request's audit line")
    mine = [x for x in map(json.loads, audit.read_text().splitlines())
            if x.get("request_id") == "killed"]
    assert len(mine) == 1 and mine[0]["error"] == "worker_lost", mine

    # A new worker (a new pid) takes the dead one's place and serves.
    wait_until(lambda: children(hub.pid) and children(hub.pid) != [worker], what="a new worker")
    new = the_worker(hub)
    hub.wait_stderr(rf"hub worker 1 \(pid {worker}\) exited with -9")
    wait_until(lambda: status(hub)["workers"]["alive"] == 2, what="two processes alive again")
    st = status(hub)["workers"]
    assert st["restarts"] == 1 and st["configured"] == 2
    assert [p["pid"] for p in st["processes"]] == [hub.pid, new]
    assert metric(hub, "appliance_hub_worker_restarts_total") == 1
    assert metric(hub, 'appliance_hub_worker_cpu_seconds{worker="1"}') >= 0
    assert metric(hub, "appliance_hub_cpu_seconds_total") > 0
    with closing(connect_to(hub, new)) as c2:
        r = c2.post("/v1/chat/completions", headers={"x-request-id": "after"},
                    json=chat_body(MODEL, max_tokens=3))
        assert r.status_code == 200, r.text
    wait_until(lambda: '"after"' in audit.read_text(), what="the new worker's request audited")
    assert f.stop(hub) == 0


def test_sighup_reaches_the_workers(procs, tmp_path):
    """The worker bounds a body itself (Hub__MaxBodyBytes): a reload raises the bound there."""
    env_file = tmp_path / "hub.env"
    env_file.write_text("Hub__MaxBodyBytes=2000\n")
    f, hub = start(procs, tmp_path, args=["--env-file", str(env_file)])
    worker = the_worker(hub)
    ready(hub)
    big = chat_body(MODEL, max_tokens=3, messages=[{"role": "user", "content": "x" * 5000}])
    with closing(connect_to(hub, worker)) as c:
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        env_file.write_text("Hub__MaxBodyBytes=100000\n")
        hub.signal(signal.SIGHUP)
        hub.wait_stderr(f"hub worker {worker}: configuration reloaded")
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 200, r.text
    with closing(connect_to(hub, worker)) as c:
        assert c.post("/v1/chat/completions", json=big).status_code == 200
    assert children(hub.pid) == [worker]  # reloaded in place, not restarted
    assert f.stop(hub) == 0


def test_tls_with_workers(procs, tmp_path):
    ca = make_ca(tmp_path)
    cert = make_cert(tmp_path, ca, "hub")
    verify = client_ctx(ca.pem)
    f, hub = start(procs, tmp_path, {"Hub__TlsCert": cert[0], "Hub__TlsKey": cert[1]},
                   node_env={"Node__TlsCa": ca.pem}, verify=verify)  # the node trusts the hub
    assert hub.url.startswith("https://")
    worker = the_worker(hub)
    ready(hub, verify=verify)
    with closing(connect_to(hub, worker, verify=verify)) as c:
        r = c.post("/v1/chat/completions", json=chat_body(MODEL, max_tokens=3))
        assert r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json=chat_body(MODEL, max_tokens=3, stream=True)) as s:
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 2
        assert c.get("/api/status", headers=ADMIN_H).json()["workers"]["alive"] == 2
    assert f.stop(hub) == 0
