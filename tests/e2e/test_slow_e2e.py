"""'Why slow' with real processes: a hub and a sim node; each audit line carries where the
request's time went, and `ctl slow` (the hub's /api/requests/slow) lists the hour's
slowest with that breakdown."""

from __future__ import annotations

import io
import json

import httpx
import pytest

from appliance import ctl
from tests.harness.fleet import Fleet, chat_body
from tests.harness.procs import Procs

pytestmark = pytest.mark.e2e

TOKEN = "slow-token"
MODEL = "sim-small"


def test_audit_breakdown_and_ctl_slow(procs: Procs, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    hub = f.start_hub({"Audit__Path": f.audit_path, "Models__0__Name": MODEL})
    f.start_node("gpu-a", {"Node__AnnounceSeconds": "1", "Sim__TokensPerSecond": "200",
                           "Sim__Models__0__Name": MODEL, "Sim__Models__0__LoadSeconds": "0.5"})
    body = chat_body(MODEL, max_tokens=20)
    with httpx.Client(base_url=hub.url, timeout=60) as client:
        # The first waits for the model's load (on demand): load_ms says so.
        r = client.post("/v1/chat/completions", json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}})
        assert r.status_code == 200
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        reqs = f.audit("request")
        assert len(reqs) == 4
        first = reqs[0]
        assert first["load_ms"] >= 400, first  # the sim's 0.5 s load, waited for
        assert first["output_tokens"] == 20 and first["decode_tps"] > 0, first
        for x in reqs:
            for key in ("queue_ms", "load_ms", "node_wait_ms", "ttfb_ms", "prefill_tokens"):
                assert isinstance(x[key], (int, float)) and x[key] >= 0, (key, x)
            assert x["node_wait_ms"] <= x["ttfb_ms"] and x["load_ms"] + x["queue_ms"] <= x["ms"]
        assert all(x["load_ms"] < first["load_ms"] for x in reqs[1:])

        out, err = io.StringIO(), io.StringIO()
        assert ctl.run(["slow"], client, out, err) == 0, err.getvalue()
        table = out.getvalue().splitlines()
        assert "NODE WAIT" in table[0] and len(table) == 5
        assert f"{first['ms']:.0f}" in table[1] and "gpu-a" in table[1]  # slowest first
        out = io.StringIO()
        assert ctl.run(["--json", "slow", "--limit", "2"], client, out, err) == 0
        got = json.loads(out.getvalue())["requests"]
        assert len(got) == 2 and got[0]["ms"] >= got[1]["ms"] and "load_ms" in got[0]
