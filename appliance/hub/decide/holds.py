"""Each key's own hold on an on-demand model: how long its Ollama `keep_alive` keeps it.

Theory of operation: the admin key, a `ManageModels` client, or anyone on a hub with no
clients sets a model's idle time for everyone (`Health.keep`, counted from
`Health.last_used`: the shared clock, which first sight, an operator's retry and a
follower's ask also start). Any other key sets only its own hold (`Holds`): its keep_alive
clipped to the model's configured idle time (`IdleUnloadSeconds`) -- shorter or longer
within it, never past it, never pinned -- and `keep_alive: 0` releases that hold alone
(placement.Models.touch).
The model stays wanted until the latest of the shared clock's end and every hold
(`until`). Bounded: one hold per key name, at most MAX_HOLDS per model; holds that ended
are dropped when the table fills, then the soonest to end.
"""

from __future__ import annotations

import math
from typing import Protocol

# Holds kept per model: one per key name (configured clients and the anonymous one).
MAX_HOLDS = 1024


class Holds:
    """The keys' holds on one model: key name -> when its hold ends (monotonic seconds)."""

    __slots__ = ("ends", "last")

    def __init__(self) -> None:
        self.ends: dict[str, float] = {}
        self.last: float | None = None  # the latest use by any key that holds (for LRU)

    def __len__(self) -> int:
        return len(self.ends)

    def hold(self, key: str, now: float, seconds: float) -> None:
        """`key` used the model at `now` and holds it `seconds` more (0: its hold ends)."""
        self.last = now
        self.ends.pop(key, None)
        if seconds <= 0:
            return
        if len(self.ends) >= MAX_HOLDS:
            self.ends = {k: t for k, t in self.ends.items() if t > now}
            if len(self.ends) >= MAX_HOLDS:
                del self.ends[min(self.ends, key=self.ends.__getitem__)]
        self.ends[key] = now + seconds

    def latest(self) -> float:
        """When the last hold ends (-inf: none)."""
        return max(self.ends.values(), default=-math.inf)

    def clear(self) -> None:
        self.ends.clear()


class Health(Protocol):
    """A model's health as holds read it (catalog.Health)."""

    last_used: float | None
    keep: float | None
    holds: Holds


def own_seconds(keep: float | None, idle: float) -> float:
    """A key's own hold: its keep_alive within the configured idle time `idle` (None: that
    time; a negative keep_alive, inf, asks to pin: that time too)."""
    return idle if keep is None else min(max(keep, 0.0), idle)


def until(last_used: float | None, limit: float, holds: Holds, now: float) -> float:
    """When the model stops being wanted: the end of the shared clock (`last_used` +
    `limit`; from now when no use was ever counted) or of the latest hold."""
    held = holds.latest()
    if last_used is None:
        return now + limit if holds.last is None else held
    return max(last_used + limit, held)


def recent(h: Health | None) -> float | None:
    """The model's latest use, shared or held (an eviction spares the latest longest)."""
    if h is None or h.holds.last is None:
        return None if h is None else h.last_used
    return h.holds.last if h.last_used is None else max(h.last_used, h.holds.last)
