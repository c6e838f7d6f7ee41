"""End to end: one U+2028 (or any Unicode line break) in a model name leaves the fleet up.

A real hub and two sim nodes; the admin pulls `x\\u2028y` onto both (the sim then lists it,
as an OpenAI upstream or a GGUF's metadata could): both nodes' watch streams carry it and
stay up, the model is served, and every audit line is one line for any reader.
"""

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.harness.fleet import Fleet

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
NAMES = ["x\u2028y", "p\u2029q", "n\x85l"]


def test_a_model_named_with_line_breaks_leaves_the_fleet_up(procs, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    hub = f.start_hub({"Audit__Path": f.audit_path, "Node__HeartbeatSeconds": "0.5"},
                      metrics=False)
    common = {"Node__AnnounceSeconds": "1", "Node__HeartbeatSeconds": "0.5",
              "Sim__Models__0__Name": "sim-small"}
    f.start_node("gpu-a", common)
    f.start_node("gpu-b", common)
    f.wait_up("gpu-a", "gpu-b")
    assert set(f.nodes()) == {"gpu-a", "gpu-b"}
    with httpx.Client(base_url=hub.url, timeout=30) as c:
        for name in NAMES:
            r = c.post("/api/pull", json={"model": name, "stream": False})
            assert r.status_code == 200 and r.json()["status"] == "success", r.text
        # Both nodes now list the names; their watch lines carry them and stay readable.
        f.wait(lambda: all(set(NAMES) <= {m["name"] for m in n["models"]}
                           for n in f.nodes().values()), "the names listed")
        time.sleep(2.0)  # several heartbeats (0.5 s): a node lost would show by now
        assert {n["status"] for n in f.nodes().values()} == {"up"}
        for name in NAMES:
            r = c.post("/api/chat", json={"model": name, "stream": True,
                                          "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            parts = [json.loads(x) for x in r.content.split(b"\n") if x]
            assert parts[-1]["done"] and parts[-1]["model"] == name
            assert len(r.text.splitlines()) == len(parts)  # one line each, for any reader
        r = c.post("/v1/chat/completions", json={"model": "sim-small", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
    text = Path(f.audit_path).read_text()
    assert text.splitlines() == text.rstrip("\n").split("\n")
    lines = [json.loads(x) for x in text.splitlines()]
    assert set(NAMES) <= {x.get("model") for x in lines}
    assert not [x for x in lines if x.get("event") == "node_lost" or x.get("kind") == "node_lost"]
