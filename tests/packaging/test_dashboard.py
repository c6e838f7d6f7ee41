"""packaging/grafana/appliance.json: a dashboard Grafana imports, about series we publish.

Three checks: the JSON has the shape Grafana's importer needs (schemaVersion, version,
panels with ids, positions, and targets with a refId and an expression); promtool parses
every expression (written as recording rules, Grafana's `$__rate_interval` replaced by a
duration); and every metric name in every expression appears in a live scrape -- a hub
with priority on and a node with its own metrics port, under a little traffic that fills
the node so requests queue, plus a second hub serving TLS for the certificate series.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading

import httpx
import pytest

from tests.harness import ROOT
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

DASHBOARD = ROOT / "packaging" / "grafana" / "appliance.json"
PROMTOOL = shutil.which("promtool")
NAME = re.compile(r"\bappliance_[a-z_]+\b")


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_grafana_can_import_it():
    d = load()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert isinstance(d["version"], int) and d["title"] and d["uid"]
    assert [i["pluginId"] for i in d["__inputs"]] == ["prometheus"]
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    kinds = {"row", "timeseries", "stat", "table", "state-timeline"}
    for p in d["panels"]:
        assert p["type"] in kinds and p["title"], p
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0 and g["y"] >= 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
    # What the issue asks to see.
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for words in ("by status", "errors", "duration", "first byte", "parked", "unplaceable",
                  "nothing ready",
                  "node state", "priority class", "waiting for admission", "leading hub",
                  "cluster up", "leader changes",
                  "certificate"):
        assert words in titles, words


@pytest.mark.skipif(PROMTOOL is None,
                    reason="promtool missing (make test installs Debian's prometheus)")
def test_promtool_parses_every_expression(tmp_path):
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, e in enumerate(exprs(load())):
        e = e.replace("$__rate_interval", "5m")
        rules += [f"      - record: dashboard:expr_{i}", f"        expr: {json.dumps(e)}"]
    (tmp_path / "rules.yml").write_text("\n".join(rules) + "\n")
    r = subprocess.run([PROMTOOL, "check", "rules", "rules.yml"], cwd=tmp_path, capture_output=True,
                       text=True,
                       timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    # It bites: a broken expression is refused.
    (tmp_path / "bad.yml").write_text("\n".join(rules[:3] + ["      - record: x",
                                                             "        expr: 'sum(rate(a[5m])'"]) + "\n")
    bad = subprocess.run([PROMTOOL, "check", "rules", "bad.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0


def _sample_names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line
            and not line.startswith("#")}


@pytest.mark.e2e
def test_every_series_is_in_a_live_scrape(procs, tmp_path):
    from tests.harness.pki import make_ca, make_cert

    fleet = Fleet(procs=procs, token="t")
    hub = fleet.start_hub({"Priority__Enabled": "true", "Queue__MaxWaitSeconds": "30",
                           "Models__0__Name": "sim-small", "Models__0__Replicas": "1"})
    node = fleet.start_node("gpu-a", {"Metrics__Listen": "127.0.0.1:0",
                                      "Node__MaxConcurrency": "1", "Node__MemoryMb": "4000",
                                      "Sim__TokensPerSecond": "50"})
    node.wait_listening("node", "metrics")
    wait_until(lambda: httpx.get(hub.url + "/api/status").json()["models"][0]["ready"] == 1,
               what="sim-small ready")
    # Three at once on a node that takes one: two wait in the queue for a while.
    codes: list[int] = []

    def chat() -> None:
        r = httpx.post(hub.url + "/v1/chat/completions", timeout=60,
                       json={"model": "sim-small", "max_tokens": 20,
                             "messages": [{"role": "user", "content": "hi"}]})
        codes.append(r.status_code)

    threads = [threading.Thread(target=chat) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert codes == [200, 200, 200]
    assert httpx.post(hub.url + "/v1/chat/completions", json={"model": "nope",
                                                              "messages": []}).status_code == 404

    # A hub serving TLS publishes the certificate's expiry.
    ca = make_ca(tmp_path)
    cert, key = make_cert(tmp_path, ca, "hub")
    tls_hub = fleet.start_hub({"Hub__TlsCert": cert, "Hub__TlsKey": key}, name="tls")

    scraped = set()
    for url in (hub.urls["metrics"], node.urls["metrics"], tls_hub.urls["metrics"]):
        scraped |= _sample_names(httpx.get(url + "/metrics", timeout=10).text)
    used = {n for e in exprs(load()) for n in NAME.findall(e)}
    assert {"appliance_queue_waiting", "appliance_tls_cert_expiry_seconds",
            "appliance_node_memory_used_mib"} <= used
    assert used - scraped == set(), f"in the dashboard but in no scrape: {sorted(used - scraped)}"
