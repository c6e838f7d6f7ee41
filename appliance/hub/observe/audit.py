"""What is kept of a finished request: its audit line, the page's recent rows, the hour's slowest.

Owns the three places a request record goes (request.py's `Recorder` builds it once and
hands the same dict to each): `AuditLog`, one JSON line per request and per node, model or
admin event, written and flushed before the response ends, to `Audit__Path` (rotated by
`Audit__MaxBytes`, `Audit__Backups` kept as PATH.1 ... PATH.N) or stdout; `Recent`, the
last RECENT_MAX records for the page; `SlowRequests`, the hour's slowest ("why slow").
Never a key: the record holds the client's name. The path is opened at start
(`check_path`: the hub exits 2 when it cannot be); a write that fails later never fails
the request: it is counted (`appliance_audit_write_errors_total` through `on_error`),
logged at most once per ERROR_LOG_SECONDS, and the file reopened at the next write.
The page's rows keep a reference to the record; their named fields are picked, each
string cut to FIELD_MAX, when a feed is read -- the request path pays one append.
Plain synchronous code, no trio: writes are small local appends, time is passed in.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from appliance.http.lines import LineEncoder

log = logging.getLogger(__name__)
# Escaped line breaks (appliance/http/lines.py): a client picks the model name in its line.
_enc = LineEncoder()
# A full disk fails every line: one log line a minute says so without flooding the log.
ERROR_LOG_SECONDS = 60.0


def check_path(path: str) -> str | None:
    """None when `path` (empty: stdout) can be opened for appending; else why not."""
    if not path:
        return None
    # A missing directory is a typo or an unmounted volume, not something to create (even
    # at /): refused at start, so the operator finds out now rather than at the first audit.
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"cannot open Audit__Path {path!r}: its directory {parent!r} does not exist"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                         0o600))  # created 0600, as _open does
    except OSError as e:
        return f"cannot open Audit__Path {path!r} for appending: {e.strerror or e}"
    return None


class AuditLog:
    def __init__(self, path: str = "", max_bytes: int = 100 * 1024 * 1024,
                 backups: int = 5) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self._fh: IO[bytes] | None = None
        self._size = 0
        self.write_errors = 0
        self.last_error = ""
        self.failing = False  # the last write failed (cleared by the next that succeeds)
        self.on_error: Callable[[], None] = lambda: None
        self._logged_at = float("-inf")

    def _open(self) -> IO[bytes]:
        if not self.path:
            return sys.stdout.buffer
        if self._fh is None:
            # Created 0600: lines name clients, models and nodes (the service's own group
            # may read it when the umask or a later chmod says so; never the world).
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._fh = os.fdopen(fd, "ab")
            self._size = self._fh.seek(0, os.SEEK_END)
        return self._fh

    def _rotate(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh = None
        for i in range(self.backups - 1, 0, -1):
            src = f"{self.path}.{i}"
            if os.path.exists(src):
                os.replace(src, f"{self.path}.{i + 1}")
        if self.backups > 0:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)

    def write(self, record: dict[str, Any]) -> None:
        line = _enc.line(record)
        try:
            fh = self._fh if self._fh is not None else self._open()
            fh.write(line)
            fh.flush()
            if self.path:
                self._size += len(line)
                if self._size >= self.max_bytes:
                    self._rotate()
            self.failing = False
        except (OSError, ValueError) as e:  # ValueError: a file closed under us
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        self.write_errors += 1
        self.failing = True
        self.last_error = f"{type(e).__name__}: {e}"
        self.on_error()
        if self._fh is not None:
            try:
                self._fh.close()
            except OSError:
                pass
            self._fh = None  # reopened at the next write
        now = time.monotonic()
        if now - self._logged_at >= ERROR_LOG_SECONDS:
            self._logged_at = now
            log.error(
                "audit line not written to %s: %s (%d lost so far; said at most once a minute)",
                      self.path or "stdout", self.last_error, self.write_errors)

    def event(self, kind: str, **fields: Any) -> None:
        self.write({"ts": round(time.time(), 3), "kind": kind, **fields})


# --- the page's feeds: the last requests, the hour's slowest -----------------------------

# The page shows the last few dozen; 200 is a screenful of scrolling and ~60 kB at most.
RECENT_MAX = 200
# The fields a recent-requests row may carry; anything else in a record stays out.
RECENT_FIELDS = ("ts", "client", "model", "path", "status", "node", "ms", "ttfb_ms", "error",
                 "priority", "request_id")
# The fields a slow row carries: who, where, and where its time went.
SLOW_FIELDS = ("ts", "client", "model", "path", "status", "error", "node", "routing", "ms",
               "ttfb_ms", "queue_ms", "load_ms", "node_wait_ms", "input_tokens",
               "cached_tokens", "prefill_tokens", "output_tokens", "decode_tps", "request_id",
               "trace_id")
# Longer than any real model name, client name or error code.
FIELD_MAX = 200
# An hour in 5-minute buckets: a request leaves the view within 5 minutes of turning an
# hour old. Each bucket keeps its PER_BUCKET slowest (a min-heap on `ms`): 12 x 20 records
# whatever the traffic; the hour's top 20 is always among them.
BUCKET_SECONDS = 300.0
BUCKETS = 12
WINDOW_SECONDS = BUCKET_SECONDS * BUCKETS
PER_BUCKET = 20
SLOW_MAX = PER_BUCKET


def shown(record: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """A feed's row: the named fields of `record`, each string cut to FIELD_MAX (a client's
    made-up model name may be as long as a body)."""
    return {k: (record[k][:FIELD_MAX] if isinstance(record[k], str) else record[k])
            for k in fields if k in record}


class Recent(deque[dict[str, Any]]):
    """The last RECENT_MAX request records, newest last: a bounded deque, so the request
    path's whole cost is its `append`."""

    def __init__(self, size: int = RECENT_MAX) -> None:
        super().__init__(maxlen=size)

    def payload(self, limit: int = RECENT_MAX) -> dict[str, Any]:
        rows = list(self)[-limit:] if limit > 0 else []
        return {"requests": [shown(r, RECENT_FIELDS) for r in reversed(rows)]}


_Entry = tuple[float, int, dict[str, Any]]


class SlowRequests:
    """The slowest requests of the last hour, by 5-minute bucket (`slowest` merges them)."""

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
        if len(heap) < PER_BUCKET:
            heapq.heappush(heap, (float(ms), next(self._tie), record))
        elif ms > heap[0][0]:
            heapq.heapreplace(heap, (float(ms), next(self._tie), record))

    def slowest(self, limit: int, now: float) -> list[dict[str, Any]]:
        """The `limit` slowest requests that ended within the last hour, slowest first."""
        since = now - WINDOW_SECONDS
        rows = [e for heap in self._buckets.values() for e in heap if e[2]["ts"] >= since]
        rows.sort(key=lambda e: (-e[0], e[1]))
        return [shown(e[2], SLOW_FIELDS) for e in rows[:max(0, min(limit, SLOW_MAX))]]

    def payload(self, limit: int, now: float) -> dict[str, Any]:
        return {"window_seconds": WINDOW_SECONDS, "requests": self.slowest(limit, now)}
