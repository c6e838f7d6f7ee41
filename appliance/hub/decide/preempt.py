"""Essential work before the first byte (Priority__Preempt): which background request gives
its place.

Theory of operation. Plain synchronous code. Admission holds here every
background request that has a place (per model, in the order they got it) while
preemption is on. When an essential request must wait for a place, `preempt_one` picks
the newest background request of the model that has not yet taken its engine's first
byte -- the newest has the least work done -- and calls its `preempt()`: the request's
relay ends it with 503 `preempted` (retryable) and closes its upstream request, and the
place it gives back wakes the essential waiter first (class order). A request that has
its first byte is never picked: a started stream is never cut. One victim per waiting
essential request; none when no background request qualifies (the essential request then
waits as it always did).
"""

from __future__ import annotations

from typing import Protocol


class Preemptible(Protocol):
    """A background request essential work may take the place of (the router's Request)."""

    def first_byte(self) -> bool: ...

    def preempt(self) -> None: ...


class Victims:
    def __init__(self) -> None:
        self._held: dict[str, dict[Preemptible, None]] = {}
        self.preempted = 0  # requests preempted since the start (/api/status)

    def hold(self, model: str, req: Preemptible) -> None:
        self._held.setdefault(model, {})[req] = None

    def release(self, model: str, req: Preemptible) -> None:
        held = self._held.get(model)
        if held is not None:
            held.pop(req, None)
            if not held:
                del self._held[model]

    def preempt_one(self, model: str) -> Preemptible | None:
        """Preempt the newest held request of `model` with no first byte; it is returned
        (None: none qualifies)."""
        held = self._held.get(model)
        if not held:
            return None
        for req in reversed(list(held)):
            if not req.first_byte():
                self.release(model, req)
                self.preempted += 1
                req.preempt()
                return req
        return None

    def held(self, model: str) -> int:
        return len(self._held.get(model, ()))

    def holding(self, model: str) -> list[Preemptible]:
        """The held requests of `model`, oldest first."""
        return list(self._held.get(model, ()))
