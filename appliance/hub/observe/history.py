"""The hub's short memory for its own page: the last 15 minutes of its counters.

Theory of operation: the page at /ui/ should show how the fleet has been doing without a
Prometheus, so the hub keeps small, bounded, in-memory records of itself (the last
requests and the hour's slowest are audit.py's, kept as their records are written):

- `History`: every `STEP_SECONDS` a sampler task reads the hub's own Prometheus objects
  (the request counter by status, the time-to-first-byte histogram, the tokens by kind,
  the queue and the priority classes) and stores one point -- rates and quantiles over the
  step, computed from the difference to the previous reading. `POINTS` points: 15
  minutes. Reading the counters happens here, off the request path; the request path pays
  nothing for it.

`History.sample` is synchronous and takes the time and the readings as arguments, so the
arithmetic is tested without a clock; `run_sampler` is the thin trio loop around it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from appliance.hub.decide.admission import Admission
    from appliance.hub.fleet.nodes import Registry
    from appliance.hub.observe.metrics import HubMetrics

# A point every 5 s keeps a 15-minute chart at 180 points: smooth enough at phone width,
# cheap to send every poll (a few kB of JSON).
STEP_SECONDS = 5.0
WINDOW_SECONDS = 15 * 60
POINTS = int(WINDOW_SECONDS / STEP_SECONDS)
CLASSES = ("essential", "normal", "background")


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs, sorted
    by bound with +Inf last; None when nothing was observed."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the last finite bucket: its bound, as Prometheus does
            if count == lower_count:
                return bound
            return lower_bound + (
                bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


class Reading:
    """One look at the counters: cumulative request counts by status, cumulative TTFB
    buckets, and the gauges as they are now."""

    __slots__ = ("requests", "ttfb", "waiting", "in_flight", "nodes_up", "tokens")

    def __init__(self, requests: dict[str, float], ttfb: dict[float, float], waiting: dict[str,
                                                                                           float],
                 in_flight: float = 0.0, nodes_up: int = 0,
                 tokens: dict[str, float] | None = None) -> None:
        self.requests, self.ttfb, self.waiting = requests, ttfb, waiting
        self.in_flight, self.nodes_up = in_flight, nodes_up
        self.tokens = tokens or {}  # cumulative tokens by kind (input, output)


class History:
    def __init__(self, points: int = POINTS) -> None:
        self.points: deque[dict[str, Any]] = deque(maxlen=points)
        self._last: Reading | None = None
        self._last_t = 0.0

    def sample(self, t: float, r: Reading) -> dict[str, Any] | None:
        """Store the point for the step ending at `t` (unix seconds); the first reading
        only sets the baseline. A counter that went down (a restart) counts from zero."""
        prev, prev_t = self._last, self._last_t
        self._last, self._last_t = r, t
        if prev is None or t <= prev_t:
            return None
        dt = t - prev_t
        rps = {}
        for status, n in r.requests.items():
            d = n - prev.requests.get(status, 0.0)
            d = n if d < 0 else d
            if d > 0:
                rps[status] = round(d / dt, 3)
        tps = {}
        for kind, n in r.tokens.items():
            d = n - prev.tokens.get(kind, 0.0)
            tps[kind] = round((n if d < 0 else d) / dt, 1)
        bounds = sorted(r.ttfb)
        deltas = [(b, max(0.0, r.ttfb[b] - prev.ttfb.get(b, 0.0))) for b in bounds]
        p50, p95 = quantile(0.5, deltas), quantile(0.95, deltas)
        point = {"t": round(t, 3), "rps": rps,
                 "ttfb_p50_ms": None if p50 is None else round(p50 * 1000, 1),
                 "ttfb_p95_ms": None if p95 is None else round(p95 * 1000, 1),
                 "waiting": dict(r.waiting), "in_flight": r.in_flight, "nodes_up": r.nodes_up,
                 "tokens_per_s": tps}
        self.points.append(point)
        return point

    def payload(self) -> dict[str, Any]:
        return {"step_seconds": STEP_SECONDS, "window_seconds": WINDOW_SECONDS,
                "points": list(self.points)}


# --- reading the hub's own Prometheus objects --------------------------------------------

def _samples(metric: Collector) -> Iterator[Sample]:
    for family in metric.collect():
        yield from family.samples


def read_hub(metrics: HubMetrics, admission: Admission, registry: Registry) -> Reading:
    """A Reading from HubMetrics, Admission and the node Registry (no I/O)."""
    requests: dict[str, float] = {}
    for s in _samples(metrics.requests):
        if s.name.endswith("_total"):
            requests[s.labels["status"]] = requests.get(s.labels["status"], 0.0) + s.value
    ttfb: dict[float, float] = {}
    for s in _samples(metrics.ttfb):
        if s.name.endswith("_bucket"):
            b = float(s.labels["le"])
            ttfb[b] = ttfb.get(b, 0.0) + s.value
    tokens: dict[str, float] = {}
    for s in _samples(metrics.tokens):
        if s.name.endswith("_total"):
            tokens[s.labels["kind"]] = tokens.get(s.labels["kind"], 0.0) + s.value
    in_flight = sum(s.value for s in _samples(metrics.in_flight))
    stats = admission.statistics()
    if admission.enabled:
        waiting = {c: float(stats["classes"].get(c, {}).get("waiting", 0)) for c in CLASSES}
    else:
        waiting = {"all": float(sum(m["waiting"] for m in stats["models"].values()))}
    nodes_up = sum(1 for h in list(registry.nodes.values()) if h.status() == "up")
    return Reading(requests, ttfb, waiting, in_flight, nodes_up, tokens)


async def run_sampler(history: History, read: Callable[[], Reading], step: float = STEP_SECONDS,
                      wall: Callable[[], float] = time.time, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Sample every `step` seconds until cancelled; the first reading is the baseline."""
    history.sample(wall(), read())
    task_status.started()
    while True:
        await trio.sleep(step)
        history.sample(wall(), read())
