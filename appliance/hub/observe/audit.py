"""The audit trail: one JSON line per request and per node, model or admin event.

Theory of operation: a line is written (and flushed) before the response ends, so a
client that saw an answer can find its line. Lines go to `Audit__Path` or, when empty,
to stdout. The file is rotated by size (`Audit__MaxBytes`, `Audit__Backups` kept as
PATH.1 ... PATH.N). Never the key itself: the client's name. Writes are small and
synchronous -- a local append is faster than handing it to a thread.

The path is opened at start (`check_path`: the hub exits 2 with one line when it cannot
be). A write that fails later (disk full, file removed with its directory) never fails
the request it describes: it is counted (`write_errors`, the hub's
`appliance_audit_write_errors_total` through `on_error`), logged at most once per
ERROR_LOG_SECONDS, and the file is reopened at the next write.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from appliance.http.lines import LineEncoder

if TYPE_CHECKING:
    from appliance.hub.observe.history import Recent
    from appliance.hub.observe.slow import SlowRequests

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
        # Set by the hub: a bounded ring (history.Recent) that keeps the last request records.
        self.recent: Recent | None = None
        self.slow: SlowRequests | None = None  # the hour's slowest (slow.py)

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
            fh = self._open()
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

    def request(self, **fields: Any) -> None:
        record = {"ts": round(time.time(), 3), "kind": "request", **fields}
        self.write(record)
        if self.recent is not None:
            self.recent.add(record)
        if self.slow is not None:
            self.slow.add(record)

    def event(self, kind: str, **fields: Any) -> None:
        self.write({"ts": round(time.time(), 3), "kind": kind, **fields})

