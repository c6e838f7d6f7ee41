"""history.py: the page's 15 minutes of counters and its ring of recent requests (no I/O)."""

from __future__ import annotations

import math

import trio
from prometheus_client import CollectorRegistry

from appliance.hub.observe import audit, history
from appliance.hub.observe.audit import Recent
from appliance.hub.observe.history import History, Reading, quantile, read_hub, run_sampler
from appliance.hub.observe.metrics import HubMetrics

INF = math.inf


def test_quantile_interpolates_like_prometheus():
    # 10 observations: 4 under 0.1 s, 4 more under 0.5 s, 2 under 1 s.
    b = [(0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (INF, 10.0)]
    assert quantile(0.5, b) == 0.1 + 0.4 * (5 - 4) / 4
    assert quantile(0.95, b) == 0.5 + 0.5 * (9.5 - 8) / 2
    assert quantile(0.2, b) == 0.1 * 2 / 4
    assert quantile(0.5, [(0.1, 0.0), (INF, 0.0)]) is None
    assert quantile(0.5, []) is None
    # Everything beyond the last finite bound: that bound.
    assert quantile(0.99, [(0.1, 0.0), (1.0, 0.0), (INF, 3.0)]) == 1.0


def test_points_are_rates_and_quantiles_over_the_step():
    h = History(points=3)
    assert h.sample(100.0, Reading({"200": 10.0}, {0.1: 5.0, 1.0: 5.0, INF: 5.0},
                                   {"all": 0.0})) is None
    p = h.sample(105.0, Reading({"200": 20.0, "503": 5.0}, {0.1: 5.0, 1.0: 15.0, INF: 15.0},
                                {"all": 2.0}, 3.0, 2))
    assert p["rps"] == {"200": 2.0, "503": 1.0}
    # The 10 new observations all fell between 0.1 and 1 s.
    assert p["ttfb_p50_ms"] == round((0.1 + 0.9 * 5 / 10) * 1000, 1)
    assert p["waiting"] == {"all": 2.0} and p["in_flight"] == 3.0 and p["nodes_up"] == 2
    # Nothing new: no rates, no quantiles; a counter that went back (a restart) counts from zero.
    p = h.sample(110.0, Reading({"200": 20.0, "503": 1.0}, {0.1: 5.0, 1.0: 15.0, INF: 15.0}, {}))
    assert p["rps"] == {"503": 0.2} and p["ttfb_p50_ms"] is None and p["ttfb_p95_ms"] is None
    # A clock that did not move stores nothing.
    assert h.sample(110.0, Reading({}, {}, {})) is None
    # Bounded: the oldest point goes.
    for t in (115.0, 120.0):
        h.sample(t, Reading({}, {}, {}))
    assert [q["t"] for q in h.payload()["points"]] == [110.0, 115.0, 120.0]
    assert history.POINTS * history.STEP_SECONDS == 15 * 60


def test_recent_is_bounded_newest_first_and_carries_only_named_fields():
    r = Recent(size=3)
    for i in range(5):
        r.append({"ts": i, "kind": "request", "client": "c", "model": f"m{i}", "status": 200,
               "authorization": "Bearer sk-x", "headers": {"x-api-key": "k"}})
    rows = r.payload()["requests"]
    assert [x["model"] for x in rows] == ["m4", "m3", "m2"]
    assert all(set(x) <= set(audit.RECENT_FIELDS) for x in rows)
    assert "sk-x" not in repr(rows)
    assert [x["model"] for x in r.payload(limit=1)["requests"]] == ["m4"]
    assert r.payload(limit=0)["requests"] == []
    # A made-up model name as long as a body is kept short.
    r.append({"ts": 9, "model": "x" * 1_000_000, "status": 404, "error": "model_not_found"})
    assert r.payload(limit=1)["requests"] == [{"ts": 9, "model": "x" * audit.FIELD_MAX,
                                               "status": 404,
                                               "error": "model_not_found"}]


class _Admission:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def statistics(self) -> dict:
        return {"classes": {"essential": {"waiting": 1}, "normal": {"waiting": 2},
                            "background": {"waiting": 3}},
                "models": {"a": {"waiting": 4}, "b": {"waiting": 1}}}


class _Node:
    def __init__(self, st: str) -> None:
        self.st = st

    def status(self) -> str:
        return self.st


class _Registry:
    nodes = {"a": _Node("up"), "b": _Node("lost"), "c": _Node("up")}


def test_read_hub_sums_the_hub_series():
    m = HubMetrics(CollectorRegistry(), _Registry())
    m.requests.labels("c1", "x", "200").inc(3)
    m.requests.labels("c2", "y", "200").inc(2)
    m.requests.labels("c2", "y", "503").inc()
    m.ttfb.labels("x").observe(0.02)
    m.ttfb.labels("y").observe(0.3)
    m.in_flight.labels("x").set(2)
    r = read_hub(m, _Admission(False), _Registry())
    assert r.requests == {"200": 5.0, "503": 1.0}
    assert r.ttfb[0.025] == 1.0 and r.ttfb[0.5] == 2.0 and r.ttfb[INF] == 2.0
    assert r.waiting == {"all": 5.0} and r.in_flight == 2.0 and r.nodes_up == 2
    assert read_hub(m, _Admission(True), _Registry()).waiting == {"essential": 1.0, "normal": 2.0,
                                                                  "background": 3.0}


async def test_sampler_takes_a_point_every_step(autojump_clock):
    h = History()
    n = 0

    def read() -> Reading:
        nonlocal n
        n += 1
        return Reading({"200": 10.0 * n}, {}, {})

    async with trio.open_nursery() as nursery:
        await nursery.start(run_sampler, h, read, 5.0, trio.current_time)
        start = trio.current_time()
        await trio.sleep(16)
        nursery.cancel_scope.cancel()
    pts = h.payload()["points"]
    assert [p["t"] for p in pts] == [start + 5, start + 10, start + 15]
    assert all(p["rps"] == {"200": 2.0} for p in pts)
