"""A listener's limits and the decisions made with them: plain data, no I/O.

Theory of operation: every listener (hub API, node API, metrics; plain or TLS) keeps the
same rules, written once in appliance/server/connection.py (per connection) and
appliance/server/serve.py (the accept loop); this module holds their numbers and the
plain decisions they use:

- `Limits`: head and body deadlines, the connection bound, the body budget, the largest
  body a request may declare.
- `LiveLimits`: the limits as the last reload (SIGHUP) left them; read at each new
  connection and request, so what starts after a reload gets the new ones and what runs
  keeps its own.
- `Busy`: a request that would pass the listener's body budget (`max_buffered_bytes`,
  counted by appliance/server/receive.py's `Budget`) is refused 503 `busy`.
- `ListenerRefusal`: the ApiError the server raises out of an app's `receive` when a rule
  is broken (`RequestTimeout`: the body was too slow; `Busy`); the connection answers it
  in the API's shape and closes. Apps with a catch-all let it through.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from appliance.http.errors import ApiError

MiB = 1024 * 1024
# Retry-After of a `busy` answer: bodies in flight finish within seconds on a LAN.
BUSY_RETRY_AFTER = 2
# After a request that held this much body, and once no body is held, freed heap is
# returned to the OS (`trim`).
TRIM_AFTER_BYTES = 8 * MiB


@dataclass(frozen=True)
class Limits:
    header_read_seconds: float = 10.0
    body_read_seconds: float = 60.0
    max_connections: int = 4096
    max_buffered_bytes: int = 256 * MiB
    # A request whose declared Content-Length is over this is refused 413 before any of
    # its body is read (0: the apps bound bodies as they read them).
    max_body_bytes: int = 0
    # A write that makes no progress this long ends the connection (net/transport.py).
    write_stall_seconds: float = 30.0
    # Paths whose bodies the app streams to disk (the hub's file uploads): their declared
    # length is bounded by `max_upload_bytes` instead.
    upload_paths: frozenset[bytes] = frozenset()
    max_upload_bytes: int = 0
    # A client that is behind (its writes wait) and reads slower than this, over waits
    # summing to `write_stall_seconds`, is ended too (net/transport.py; 0: any rate).
    min_read_bytes_per_second: int = 0


class LiveLimits:
    """A listener's `Limits` as the last reload left them (read at each new connection and
    request); `set` replaces them and tells each running listener (`following`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.now = limits if limits is not None else Limits()
        self._followers: list[Callable[[Limits], None]] = []

    def set(self, limits: Limits) -> bool:
        """New limits from now on; whether they differ from the old ones."""
        changed, self.now = limits != self.now, limits
        for follow in list(self._followers):
            follow(limits)
        return changed

    @contextmanager
    def following(self, follow: Callable[[Limits], None]) -> Iterator[None]:
        """`follow(limits)` now and on every `set`, while the block runs."""
        self._followers.append(follow)
        try:
            follow(self.now)
            yield
        finally:
            self._followers.remove(follow)


def live_limits(limits: Limits | LiveLimits) -> LiveLimits:
    return limits if isinstance(limits, LiveLimits) else LiveLimits(limits)


class ListenerRefusal(ApiError):
    """A listener rule broken while an app read its body: raised out of the app's
    `receive`; the connection answers it in the API's shape (and closes). An app that
    catches it lets it through, or answers it as the ApiError it is."""


class RequestTimeout(ListenerRefusal):
    def __init__(self, seconds: float | None = None) -> None:
        super().__init__(408, "request_timeout", "request body not received within "
                         + (f"{seconds:g} s" if seconds is not None else "its deadline"))


class Busy(ListenerRefusal):
    def __init__(self) -> None:
        super().__init__(503, "busy", "the server holds too many request bodies now; "
                         "retry shortly", retry_after=BUSY_RETRY_AFTER)


def _load_trim() -> Callable[..., Any]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back
        return lambda *_: 0


_malloc_trim = _load_trim()


def trim() -> None:
    """Hand freed heap back to the OS. glibc keeps the 64 KiB pieces a body arrives in as
    free heap, so after a burst of big bodies the process stayed hundreds of MB above its
    idle size; malloc_trim returns it (a few ms, only after a big body, only when no body
    is held any more)."""
    _malloc_trim(0)
