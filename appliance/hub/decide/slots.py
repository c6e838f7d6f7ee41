"""Slot waits: requests sent to a node but held for one of its slots for the model (DESIGN 5).

The same idea as priority.py's capacity queue, per node and model: a non-essential
request whose node has more requests sent for the model than slots waits for one to
finish, in class order, first in first out. Plain synchronous code like priority.py: no
trio, no clock; admission.py is the shell that waits.
"""

from __future__ import annotations

from appliance.hub.decide.lanes import Lanes, Waiter
from appliance.hub.decide.priority import ESSENTIAL


class SlotQueues:
    """Requests sent to a node but held for one of its slots for the model (DESIGN 5).

    `in_flight` is the hub's count for the node and model with this request counted; the
    requests of that count not waiting here have been sent. A request waits while as many
    as `slots` have been sent; a finished one lets the next in (class order, FIFO).
    """

    def __init__(self) -> None:
        self.queues: dict[tuple[str, str], Lanes] = {}

    def enter(self, node: str, model: str, cls: str, in_flight: int,
              slots: int | None) -> Waiter | None:
        """None: send now. A Waiter: wait on it (essential never waits)."""
        if cls == ESSENTIAL or slots is None:
            return None
        key = (node, model)
        q = self.queues.get(key)
        waiting = len(q) if q is not None else 0
        if waiting == 0 and in_flight - 1 < slots:
            return None
        if q is None:
            q = self.queues[key] = Lanes()
        w = Waiter(model, cls, "")
        q.add(w)
        return w

    def dispatch(self, node: str, model: str, in_flight: int, slots: int | None,
                 routable: bool) -> list[Waiter]:
        """The waiters that may be sent now: slots freed, or the node gone (sent anyway)."""
        q = self.queues.get((node, model))
        if q is None:
            return []
        woken = []
        if slots is None or not routable:
            free = len(q)
        else:
            free = slots - (in_flight - len(q))
        while free > 0 and len(q):
            w = q.pop_head()
            w.granted = True
            woken.append(w)
            free -= 1
        if not len(q):
            del self.queues[(node, model)]
        return woken

    def leave(self, node: str, w: Waiter) -> None:
        key = (node, w.model)
        q = self.queues.get(key)
        if q is not None and q.remove(w) and not len(q):
            del self.queues[key]

    def keys(self) -> list[tuple[str, str]]:
        return list(self.queues)
