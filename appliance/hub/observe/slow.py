"""The slowest requests of the last hour, with where their time went ("why slow").

Theory of operation: the audit log hands every request record it has written to
`SlowRequests.add` (as it does to history.py's `Recent`). The hour is cut into
`BUCKETS` buckets of `BUCKET_SECONDS`; each keeps only its `PER_BUCKET` slowest records
(a min-heap on `ms`), so memory is bounded (12 x 20 small dicts) whatever the traffic,
and an insert costs a heap push at most. `slowest(limit, now)` merges the buckets still
inside the hour. Only the named, harmless fields are kept, each string cut short -- the
record holds the client's name, never a key. Plain synchronous code: time is passed in.
Served at `GET /api/requests/slow` (the admin key, as the page's other feeds) for the
page and `appliance ctl slow`.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

# An hour in 5-minute buckets: a request leaves the view within 5 minutes of turning an
# hour old.
BUCKET_SECONDS = 300.0
BUCKETS = 12
WINDOW_SECONDS = BUCKET_SECONDS * BUCKETS
# Each bucket's slowest; the hour's top 20 is always among them.
PER_BUCKET = 20
SLOW_MAX = PER_BUCKET
SLOW_FIELDS = ("ts", "client", "model", "path", "status", "error", "node", "routing", "ms",
               "ttfb_ms", "queue_ms", "load_ms", "node_wait_ms", "input_tokens",
               "cached_tokens", "prefill_tokens", "output_tokens", "decode_tps", "request_id",
               "trace_id")
_SLOW_SET = frozenset(SLOW_FIELDS)
FIELD_MAX = 200

_Entry = tuple[float, int, dict[str, Any]]


class SlowRequests:
    def __init__(self) -> None:
        # bucket number (ts // BUCKET_SECONDS) -> min-heap of (ms, tie, record)
        self._buckets: dict[int, list[_Entry]] = {}
        self._tie = itertools.count()

    def add(self, record: dict[str, Any]) -> None:
        ms, ts = record.get("ms"), record.get("ts")
        if not isinstance(ms, (int, float)) or not isinstance(ts, (int, float)):
            return
        n = int(ts // BUCKET_SECONDS)
        heap = self._buckets.get(n)
        if heap is None:
            heap = self._buckets[n] = []
            for old in [b for b in self._buckets if b <= n - BUCKETS]:
                del self._buckets[old]
        if len(heap) >= PER_BUCKET and ms <= heap[0][0]:
            return
        kept = {k: (v[:FIELD_MAX] if isinstance(v, str) else v)
                for k, v in record.items() if k in _SLOW_SET}
        entry = (float(ms), next(self._tie), kept)
        if len(heap) < PER_BUCKET:
            heapq.heappush(heap, entry)
        else:
            heapq.heapreplace(heap, entry)

    def slowest(self, limit: int, now: float) -> list[dict[str, Any]]:
        """The `limit` slowest requests that ended within the last hour, slowest first."""
        since = now - WINDOW_SECONDS
        rows = [e for heap in self._buckets.values() for e in heap if e[2]["ts"] >= since]
        rows.sort(key=lambda e: (-e[0], e[1]))
        return [e[2] for e in rows[:max(0, min(limit, SLOW_MAX))]]

    def payload(self, limit: int, now: float) -> dict[str, Any]:
        return {"window_seconds": WINDOW_SECONDS, "requests": self.slowest(limit, now)}
