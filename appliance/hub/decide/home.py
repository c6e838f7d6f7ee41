"""Home waits: requests held for a place on the node that holds their prompt.

Theory of operation. Plain synchronous bookkeeping; the shell (admission.py's `Place`)
waits on the event it is given, bounded by what cost.py's `home_wait` said. A home waiter
is counted in flight on its node from the start (so every other request sees the node's
queue as it is, and admission's room and the reserve stay exact); the requests counted
there and not waiting here have been sent. When a place frees on the node, waiters go in
class order, first in first out within a class. A waiter whose bound passes moves to the
cheapest other node (the shell re-picks); one whose node goes away is let go at once.

Outcomes, counted per model (`appliance_home_waits_total{model,outcome}`): `home` (it got
its place there), `moved` (the bound passed: it went elsewhere), `sent` (the bound passed
and no other node could take it: sent to its home anyway, the engine queues it),
`cancelled` (its client hung up).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from appliance.hub.decide.lanes import RANK

HOME, MOVED, SENT, CANCELLED = "home", "moved", "sent", "cancelled"
OUTCOMES = (HOME, MOVED, SENT, CANCELLED)


class Wakeup(Protocol):
    def set(self) -> None: ...


class HomeWaiter:
    __slots__ = ("node", "model", "cls", "granted", "event", "predicted")

    def __init__(self, node: str, model: str, cls: str, predicted: float) -> None:
        self.node, self.model, self.cls = node, model, cls
        self.granted = False
        self.event: Wakeup | None = None
        self.predicted = predicted  # seconds cost.py expected it to wait


class HomeQueues:
    """Waiters per (node, model), a FIFO per class; counts per (model, outcome)."""

    def __init__(self) -> None:
        self.queues: dict[tuple[str, str], tuple[deque[HomeWaiter], ...]] = {}
        self.outcomes: dict[tuple[str, str], int] = {}

    def enter(self, node: str, model: str, cls: str, predicted: float) -> HomeWaiter:
        key = (node, model)
        q = self.queues.get(key)
        if q is None:
            q = self.queues[key] = (deque(), deque(), deque())
        w = HomeWaiter(node, model, cls, predicted)
        q[RANK.get(cls, 1)].append(w)
        return w

    def waiting(self, node: str, model: str) -> int:
        q = self.queues.get((node, model))
        return sum(len(lane) for lane in q) if q is not None else 0

    def dispatch(self, node: str, model: str, free: int | None, routable: bool) -> list[HomeWaiter]:
        """The waiters that go now. `free`: the node's places left for the model with the
        waiters counted in flight (None: unbounded); a node gone lets everyone go."""
        key = (node, model)
        q = self.queues.get(key)
        if q is None:
            return []
        n = sum(len(lane) for lane in q)
        room = n if free is None or not routable else free + n
        woken: list[HomeWaiter] = []
        for lane in q:
            while lane and room > 0:
                w = lane.popleft()
                w.granted = True
                woken.append(w)
                room -= 1
        if not any(q):
            del self.queues[key]
        return woken

    def leave(self, w: HomeWaiter) -> None:
        key = (w.node, w.model)
        q = self.queues.get(key)
        if q is None:
            return
        lane = q[RANK.get(w.cls, 1)]
        if w in lane:
            lane.remove(w)
        if not any(q):
            del self.queues[key]

    def count(self, model: str, outcome: str) -> None:
        self.outcomes[(model, outcome)] = self.outcomes.get((model, outcome), 0) + 1

    def keys(self) -> list[tuple[str, str]]:
        return list(self.queues)

    def by_model(self) -> dict[str, dict[str, int]]:
        """Outcomes per model, for status."""
        out: dict[str, dict[str, int]] = {}
        for (model, outcome), n in self.outcomes.items():
            out.setdefault(model, {})[outcome] = n
        return out
