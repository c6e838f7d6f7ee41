"""'Why slow' without a tracing stack: the audit line's breakdown (hub/api/request.py) and
the hour's slowest requests (hub/observe/audit.py), decided without sockets; `ctl slow`."""

from __future__ import annotations

from appliance.ctl import render
from appliance.hub.api.request import token_breakdown
from appliance.hub.observe.audit import BUCKET_SECONDS, PER_BUCKET, SlowRequests


def test_the_hours_slowest_come_first_and_older_ones_leave():
    s = SlowRequests()
    t0 = 1_000_000.0
    for i in range(500):  # 500 requests over ~83 minutes
        s.add({"ts": t0 + i * 10, "ms": float(i % 97), "model": "m", "key": "never kept"})
    now = t0 + 500 * 10
    rows = s.slowest(10, now)
    assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
    assert rows[0]["ms"] == 96.0 and all(r["ts"] >= now - 3600 for r in rows)
    assert all("key" not in r for r in rows)
    assert sum(len(h) for h in s._buckets.values()) <= 13 * PER_BUCKET  # bounded
    assert s.slowest(1000, now) == s.slowest(20, now)  # at most 20
    assert s.slowest(10, now + 3600 + BUCKET_SECONDS) == []  # all older than the hour


def test_a_slow_request_among_many_fast_ones_is_kept():
    s = SlowRequests()
    s.add({"ts": 10.0, "ms": 9000.0, "model": "slow", "queue_ms": 8500.0})
    for i in range(10_000):
        s.add({"ts": 10.0 + i * 0.01, "ms": 5.0, "model": "fast"})
    top = s.slowest(3, 200.0)
    assert top[0]["model"] == "slow" and top[0]["queue_ms"] == 8500.0
    assert s.payload(3, 200.0)["window_seconds"] == 3600.0
    long = "x" * 5000
    s.add({"ts": 11.0, "ms": 10_000.0, "model": long})
    assert len(s.slowest(1, 200.0)[0]["model"]) == 200


def test_prefill_and_decode_rate():
    assert token_breakdown(1000, 101, 600, 0.5, 2.5) == {"prefill_tokens": 400,
                                                        "decode_tps": 50.5}
    assert token_breakdown(10, 5, None, 1.0, 1.0) == {"prefill_tokens": 10}  # came whole
    assert token_breakdown(10, 5, None, None, 1.0) == {"prefill_tokens": 10}


def test_ctl_slow_table():
    rows = [{"ts": 0, "client": "team-a", "model": "m", "node": "gpu-a", "status": 200,
             "ms": 9123.4, "load_ms": 4000.0, "queue_ms": 3000.0, "node_wait_ms": 2000.0,
             "ttfb_ms": 9000.0, "prefill_tokens": 400, "cached_tokens": 600,
             "output_tokens": 12, "decode_tps": 97.6, "trace_id": "ab" * 16}]
    text = render("slow", {"requests": rows})
    head, line = text.splitlines()[:2]
    for col in ("LOAD", "QUEUE", "NODE WAIT", "TTFT", "PREFILL/CACHED", "TOK/S"):
        assert col in head
    for cell in ("team-a", "9123", "4000", "3000", "2000", "400/600", "97.6", "ab" * 16):
        assert cell in line
    assert render("slow", {"requests": []}) == "no requests in the last hour"
