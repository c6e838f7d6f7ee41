"""Waits on one node: the trio shell of slots.py (slot waits) and home.py (home waits).

Owns `NodeWaits`. A slot wait holds a non-essential request while its node's slots for
the model are all sent (`Queue__SlotWaitSeconds`); a home wait holds a request for a place
on the node that holds its prompt, at most what cost.py's `home_wait` said, then moves it
to the cheapest other node (or sends it home anyway: its engine queues it). Each waiter
gets a `trio.Event`, set when the core says it may go (`wake`: every change of the fleet
and every finished request, through admission) -- no polling, each wait bounded here from
configuration; a waiter whose client hangs up leaves at once. It decides nothing (the
cores do) and picks no node (admission does, through the place it moves).
"""

from __future__ import annotations

from typing import Protocol

import trio

from appliance.hub.decide.affinity import Route
from appliance.hub.decide.home import CANCELLED, HOME, MOVED, SENT, HomeQueues
from appliance.hub.decide.priority import ESSENTIAL
from appliance.hub.decide.slots import SlotQueues
from appliance.hub.fleet.nodes import NodeHandle, Registry


class Moving(Protocol):
    """A request's place as a home wait moves it (admission.Place)."""

    model: str
    cls: str
    node: NodeHandle | None
    tried: list[str]
    route: Route | None
    home: float

    def give_back(self) -> None: ...
    def take(self, may_wait: bool = True) -> None: ...
    def back_to(self, node: NodeHandle) -> None: ...


class NodeWaits:
    def __init__(self, registry: Registry, homes: HomeQueues, slot_wait: float) -> None:
        self.registry = registry
        self.slots = SlotQueues()
        self.homes = homes  # cost.py's CostRouter.queues
        self.slot_wait = slot_wait  # Queue__SlotWaitSeconds (0: no slot waits)

    def wake(self) -> None:
        """Whoever may go now goes (admission calls it while someone waits here)."""
        if self.slots.queues:
            for node, model in self.slots.keys():
                self._dispatch_slots(node, model)
        if self.homes.queues:
            for node, model in self.homes.keys():
                self._dispatch_home(node, model)

    # --- home waits (home.py) ------------------------------------------------------------

    async def wait_home(self, p: Moving) -> None:
        """Hold `p` on its node (counted in flight there) until a place frees, at most
        `p.home` seconds; then it moves to the cheapest other node that can take it."""
        node, bound, route = p.node, p.home, p.route
        assert node is not None
        p.home = 0.0
        predicted = route.predicted[0] if route is not None and route.predicted else 0.0
        queues = self.homes
        w = queues.enter(node.name, p.model, p.cls, predicted)
        w.event = woken = trio.Event()
        self._dispatch_home(node.name, p.model)
        t0 = trio.current_time()
        try:
            with trio.move_on_after(bound):
                await woken.wait()
        except BaseException:
            if not w.granted:
                queues.leave(w)
            queues.count(p.model, CANCELLED)
            raise
        outcome = HOME
        if not w.granted:
            queues.leave(w)
            p.give_back()
            p.take(may_wait=False)  # anywhere but home
            if p.node is None:  # nowhere else: back home, sent anyway (its engine queues)
                outcome = SENT
                p.back_to(node)
            else:
                outcome = MOVED
                p.tried.remove(node.name)  # a move is not a failed attempt
        queues.count(p.model, outcome)
        if route is not None:
            route.home_wait = (predicted, trio.current_time() - t0, outcome)

    def _dispatch_home(self, name: str, model: str) -> None:
        h = self.registry.nodes.get(name)
        routable = h is not None and h.ready(model)
        free = h.places_left(model) if h is not None else None
        for w in self.homes.dispatch(name, model, free, routable):
            if w.event is not None:
                w.event.set()

    # --- slot waits ----------------------------------------------------------------------

    async def wait_slot(self, node: NodeHandle, model: str, cls: str) -> None:
        """Hold a non-essential request while its node's slots for `model` are all sent."""
        if self.slot_wait <= 0 or cls == ESSENTIAL or node.state is None:
            return
        w = self.slots.enter(node.name, model, cls, node.in_flight.get(model, 0),
                             node.state.model_slots(model))
        if w is None:
            return
        w.event = woken = trio.Event()
        self._dispatch_slots(node.name, model)
        try:
            with trio.move_on_after(self.slot_wait):
                await woken.wait()
        finally:
            if not w.granted:
                self.slots.leave(node.name, w)  # ran out: sent anyway; or cancelled

    def _dispatch_slots(self, name: str, model: str) -> None:
        h = self.registry.nodes.get(name)
        if h is None or h.state is None:
            woken = self.slots.dispatch(name, model, 0, None, False)
        else:
            woken = self.slots.dispatch(name, model, h.in_flight.get(model, 0),
                                        h.state.model_slots(model),
                                        h.routable())
        for w in woken:
            if w.event is not None:
                w.event.set()
