"""Generation probes with real processes: a hub and two sim nodes, one of whose model hangs
(`Sim__Models__N__Hang`: loaded, /health fine, no generation ever starts). It is marked
unhealthy, streams sent to it are retried on the other node before their first byte, the
hub says why (status, ctl's table, series, audit), and once the hang is switched off (a
SIGHUP re-reads the node's env file) a probe brings it back."""

from __future__ import annotations

import json
import re
import signal

import httpx
import pytest

from appliance.ctl import nodes_table
from tests.harness.fleet import Fleet
from tests.harness.procs import Procs, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "probe-token"
MODEL = "sim-small"


def _node_env(hang: bool) -> str:
    return "\n".join([f"Sim__Models__0__Name={MODEL}", "Sim__Models__0__LoadSeconds=0",
                      f"Sim__Models__0__Hang={'true' if hang else 'false'}",
                      "Node__ProbeSeconds=1", "Node__ProbeTimeoutSeconds=1.5"]) + "\n"


def _health(status: dict, node: str) -> tuple[str, str]:
    for n in status["nodes"]:
        if n["name"] == node:
            for m in n["models"]:
                if m["name"] == MODEL:
                    return m["health"], m["health_error"]
    return "", ""


def _stream(url: str) -> str:
    body = {"model": MODEL, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "hello"}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    assert text.rstrip().endswith("data: [DONE]"), text
    return text


def test_a_hung_replica_is_marked_unhealthy_routed_around_and_restored(procs: Procs, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    audit = tmp_path / "audit.jsonl"
    hub = f.start_hub({"Audit__Path": str(audit), "Models__0__Name": MODEL})
    env_a, env_b = tmp_path / "a.env", tmp_path / "b.env"
    env_a.write_text(_node_env(hang=True))
    env_b.write_text(_node_env(hang=False))
    nodes = {}
    for name, env_file in (("gpu-a", env_a), ("gpu-b", env_b)):
        p = f.start_node(name, {"Node__AnnounceSeconds": "1"},
                         args=["--env-file", str(env_file)])
        r = httpx.post(p.url + f"/node/v1/models/{MODEL}/load",
                       headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
        nodes[name] = p

    status = f.status

    # Streams while gpu-a hangs: every one is answered in full, and none by gpu-a (a stream
    # sent there before it was known to hang is cut before its first byte and retried).
    for _ in range(4):
        _stream(hub.url)
    wait_until(lambda: _health(status(), "gpu-a")[0] == "replica_unhealthy", 30,
               "gpu-a unhealthy")
    health, why = _health(status(), "gpu-a")
    assert why and ("one-token generation" in why or "no first byte" in why), why
    assert _health(status(), "gpu-b") == ("ok", "")
    for _ in range(4):
        _stream(hub.url)
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    served = [x for x in lines if x["kind"] == "request"]
    assert len(served) == 8 and all(x["status"] == 200 for x in served), served
    assert {x["node"] for x in served} == {"gpu-b"}
    assert any(x["kind"] == "replica_unhealthy" and x["node"] == "gpu-a" and x["reason"]
               for x in lines)
    table = nodes_table(list(f.admin_nodes().values()))
    assert "UNHEALTHY" in table and "gpu-a" in table
    metrics = httpx.get(hub.url + "/metrics", timeout=10).text
    assert re.search(r'appliance_replica_healthy\{model="sim-small",node="gpu-a"\} 0\.0', metrics)
    assert re.search(r'appliance_replica_healthy\{model="sim-small",node="gpu-b"\} 1\.0', metrics)

    # The hang switched off: the next probe generates and gpu-a is routed to again.
    env_a.write_text(_node_env(hang=False))
    nodes["gpu-a"].signal(signal.SIGHUP)
    wait_until(lambda: _health(status(), "gpu-a")[0] == "ok", 30, "gpu-a healthy again")

    def served_by_a() -> bool:
        _stream(hub.url)
        return any(x["kind"] == "request" and x["node"] == "gpu-a"
                   for x in map(json.loads, audit.read_text().splitlines()))
    wait_until(served_by_a, 30, "gpu-a serving again")
    metrics = httpx.get(hub.url + "/metrics", timeout=10).text
    failures = re.search(r'appliance_probe_failures_total\{model="sim-small",node="gpu-a"\} '
                         r'(\S+)', metrics)
    if "one-token generation" in why:  # a probe marked it (not a stream's first-byte bound)
        assert failures is not None and float(failures.group(1)) >= 1
    assert "replica_healthy" in audit.read_text()
