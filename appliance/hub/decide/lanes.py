"""A model's admission queue: its waiters, by class, each class fair between keys.

Owns `Waiter` (one request waiting for a place; the shell's event wakes it) and `Lanes`
(the classes in order, each a fair.py `FairLane`: the key served least first, FIFO within
a key; O(1) removal), and the classes' order itself. Plain data: who may go and when is
priority.py's `AdmissionCore`; it must not decide.
"""

from __future__ import annotations

from typing import Protocol

from appliance.hub.decide.fair import FairLane

CLASSES = ("essential", "normal", "background")
RANK = {c: i for i, c in enumerate(CLASSES)}


class Wakeup(Protocol):
    """The shell's trio.Event a waiter sleeps on (the core only holds it)."""

    def set(self) -> None: ...
    async def wait(self) -> None: ...


class Waiter:
    """One request waiting for admission. `event` belongs to the shell (a trio.Event)."""

    __slots__ = ("model", "cls", "client", "granted", "event", "cost", "weight", "fair")

    def __init__(self, model: str, cls: str, client: str, cost: int = 0,
                 weight: float = 1.0) -> None:
        self.model = model
        self.cls = cls
        self.client = client
        self.granted = False
        self.event: Wakeup | None = None  # the shell's trio.Event
        # fair.py: the charge at grant, the key's weight, and (lane, episode) once charged
        self.cost = cost
        self.weight = weight
        self.fair: tuple[FairLane, int] | None = None


class Lanes:
    """Waiters in class order; within a class the fair share between keys (fair.py: FIFO
    for one key); O(1) removal."""

    __slots__ = ("lanes", "pending")

    def __init__(self) -> None:
        self.lanes = (FairLane(), FairLane(), FairLane())
        self.pending = 0

    def __len__(self) -> int:
        return len(self.lanes[0]) + len(self.lanes[1]) + len(self.lanes[2])

    def at_or_above(self, cls: str) -> int:
        """How many wait in `cls` or a higher class."""
        return sum(len(self.lanes[r]) for r in range(RANK[cls] + 1))

    def add(self, w: Waiter) -> None:
        self.lanes[RANK[w.cls]].add(w)

    def remove(self, w: Waiter) -> bool:
        return self.lanes[RANK[w.cls]].remove(w)

    def head(self) -> Waiter | None:
        for lane in self.lanes:
            if lane:
                w: Waiter = lane.head()
                return w
        return None

    def pop_head(self) -> Waiter:
        for lane in self.lanes:
            if lane:
                w: Waiter = lane.pop()
                return w
        raise IndexError("no waiter")
