"""Replicas that follow demand: an on-demand model's replica count.

Theory of operation. Plain synchronous code; time comes in as an argument. An on-demand
model gets one replica when asked for (placement.py). While its predicted wait for a place
-- the shortest over its ready replicas (cost.py: the requests ahead there at the observed
service time), plus its queue in the hub -- stays above `DEMAND_WAIT_SECONDS` for
`DEMAND_HOLD_SECONDS`, the model wants one more replica, up to `Models__N__MaxReplicas`;
the next one only once that one is placed and the wait still stays above. Placement puts
it where a replica fits as always (loads count against placement and parking as today).
When the wait has fallen, a replica beyond the first whose node served the model nothing
for `Models__N__IdleUnloadSeconds` is unloaded, and the count falls with it.

Admission reports the wait on each request it places (`observe`) and every request's end
on its node (`used`); an observation older than `DEMAND_HOLD_SECONDS` says nothing (no
requests: no demand).
"""

from __future__ import annotations

from dataclasses import dataclass

# A predicted wait for a place this long is a queue worth another replica: a few answers'
# time (an activation of a small model takes about as long).
DEMAND_WAIT_SECONDS = 5.0
# ... held this long, not a burst: about one activation window of a small model.
DEMAND_HOLD_SECONDS = 10.0


@dataclass(slots=True)
class ModelDemand:
    target: int = 1  # replicas wanted now (>= 1 while the model is wanted at all)
    since: float | None = None  # when the wait first went above the bound (None: below)
    seen: float = float("-inf")  # the last observation
    grown: float = float("-inf")  # when the target last grew


class ReplicaDemand:
    def __init__(self) -> None:
        self.models: dict[str, ModelDemand] = {}
        self.last_used: dict[tuple[str, str], float] = {}  # (node, model) -> a request ended
        # The models whose replicas follow demand (on demand, MaxReplicas > 1): admission
        # reports only theirs -- for any other model there is nothing to decide.
        self.follows: frozenset[str] = frozenset()

    def _m(self, model: str) -> ModelDemand:
        d = self.models.get(model)
        if d is None:
            d = self.models[model] = ModelDemand()
        return d

    def observe(self, model: str, wait_s: float, now: float) -> None:
        d = self._m(model)
        d.seen = now
        if wait_s > DEMAND_WAIT_SECONDS:
            if d.since is None:
                d.since = now
        else:
            d.since = None

    def used(self, node: str, model: str, now: float) -> None:
        self.last_used[(node, model)] = now

    def pressed(self, model: str, now: float) -> bool:
        """The wait has stayed above the bound for DEMAND_HOLD_SECONDS, and still does."""
        d = self.models.get(model)
        return (d is not None and d.since is not None and now - d.seen < DEMAND_HOLD_SECONDS
                and now - d.since >= DEMAND_HOLD_SECONDS)

    def target(self, model: str) -> int:
        d = self.models.get(model)
        return d.target if d is not None else 1

    def grow(self, model: str, placed: int, most: int, now: float) -> bool:
        """One more replica wanted? Only while pressed, once the last one is placed
        (`placed` ready or loading reaches the target), at most `most`."""
        d = self._m(model)
        if (placed >= d.target and d.target < most and self.pressed(model, now)
                and now - d.grown >= DEMAND_HOLD_SECONDS):
            d.target += 1
            d.grown = now
            return True
        return False

    def surplus(self, model: str, ready: list[str], idle_limit: float,
                now: float) -> str | None:
        """A replica beyond the first to unload now: the wait has fallen, and its node
        served the model nothing for `idle_limit` seconds (None: none)."""
        d = self.models.get(model)
        if d is None or d.target <= 1 or len(ready) <= 1 or self.pressed(model, now) \
                or (d.since is not None and now - d.seen < DEMAND_HOLD_SECONDS):
            return None
        for node in sorted(ready, key=lambda n: self.last_used.get((n, model), -1.0)):
            if now - self.last_used.get((node, model), d.grown) >= idle_limit:
                return node
        return None

    def shrunk(self, model: str) -> None:
        d = self._m(model)
        d.target = max(1, d.target - 1)

    def reset(self, model: str) -> None:
        """The model is not wanted any more (idle unload of its last replica)."""
        self.models.pop(model, None)
