"""A request's place: the node it is on now, counted in flight, and the nodes it was on.

Owns `Place` (made by `Admission.place`: taken, moved on, given back), its `Ticket` (the
admission it was granted), `Prompt` (what affinity keys it on) and `Gauge` (the in-flight
count it moves). It decides nothing: which node, and how long to wait, is admission's
(`Placer`, the part of `Admission` it calls).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import trio

from appliance.hub.decide.affinity import Route
from appliance.hub.decide.demand import ReplicaDemand
from appliance.hub.decide.fair import FairLane
from appliance.hub.decide.priority import ESSENTIAL
from appliance.hub.fleet.nodes import NodeHandle, Registry


class Placer(Protocol):
    """What a place asks of admission (admission.Admission)."""

    registry: Registry
    demand: ReplicaDemand | None
    slot_wait: float  # Queue__SlotWaitSeconds (0: no slot waits)

    def pick(self, model: str, route: Route | None, tried: list[str],
             may_wait: bool = True) -> tuple[NodeHandle | None, float]: ...
    async def wait_home(self, p: Place) -> None: ...
    async def wait_slot(self, node: NodeHandle, model: str, cls: str) -> None: ...


class Prompt(NamedTuple):
    """What affinity keys a request on: its decoded body, its headers, its size in bytes."""

    body: dict[str, Any]
    headers: Iterable[tuple[bytes, bytes]]
    size: int


class Gauge(Protocol):
    """A gauge's child (prometheus_client): the in-flight count of one model."""

    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


class Place:
    """A request's place: the node it is on now (`node`, counted in flight) and the
    nodes it was on (`tried`). Made by `Admission.place`."""

    __slots__ = ("_admission", "model", "cls", "_in_flight", "node", "tried", "ticket",
                 "route", "home", "sent_at", "clean", "_served")

    def __init__(self, admission: Placer, model: str, cls: str, in_flight: Gauge | None,
                 ticket: Ticket, route: Route | None = None) -> None:
        self._admission, self.model, self.cls = admission, model, cls
        self._in_flight = in_flight  # the appliance_in_flight gauge's child for `model`
        self.node: NodeHandle | None = None
        self.tried: list[str] = []
        self.ticket = ticket
        self.route = route  # the affinity key admission made (None: none)
        self.home = 0.0  # seconds to wait on `node` for a place there (cost.py), 0: none
        self.sent_at = 0.0  # time.perf_counter() when it went to its node
        self.clean = False  # it went with a place (its time is the node's service time)
        # (first byte's time.perf_counter(), the engine's (prompt, cached) tokens) once
        # `node` answered (`served`)
        self._served: tuple[float | None, tuple[int, int] | None] | None = None

    def served(self, first_at: float | None, cache: tuple[int, int] | None) -> None:
        """Its node answered (200): `first_at`, time.perf_counter() of the first byte;
        `cache`, (prompt, cached) tokens as the engine reported them, if it did. Affinity's
        index and the cost's rates learn it when the place is given back."""
        self._served = (first_at, cache)

    def _take(self, may_wait: bool = True) -> None:
        registry = self._admission.registry
        node, self.home = self._admission.pick(self.model, self.route, self.tried, may_wait)
        if node is not None:
            self.tried.append(node.name)
            registry.start(node, self.model)
            if self._in_flight is not None:
                self._in_flight.inc()
        self.node = node

    def _give_back(self) -> None:
        node, self.node = self.node, None
        if node is not None:
            demand = self._admission.demand
            if demand is not None and self.model in demand.follows:
                demand.used(node.name, self.model, trio.current_time())
            if self._in_flight is not None:
                self._in_flight.dec()
            self._admission.registry.finish(node, self.model)

    async def wait_slot(self) -> None:
        """Hold it for a place on its home node while that pays (home.py); then hold a
        non-essential request while its node's slots for the model are all sent."""
        if self.node is not None and self.home > 0:
            await self._admission.wait_home(self)
        if self.node is not None:
            if self._admission.slot_wait > 0 and self.cls != ESSENTIAL:
                await self._admission.wait_slot(self.node, self.model, self.cls)
            left = self.node.places_left(self.model)
            self.clean = left is None or left >= 0
        self.sent_at = time.perf_counter()

    def next(self, max_attempts: int) -> NodeHandle | None:
        """Give the current node back; take the next other (None: none left, or
        `max_attempts` nodes tried)."""
        self._give_back()
        if len(self.tried) < max_attempts:
            self._take()
        return self.node


@dataclass(slots=True)
class Ticket:
    """The admission a request was granted."""

    model: str
    cls: str
    client: str
    waited: bool = False
    fair: tuple[FairLane, int] | None = None  # the lane and episode it was charged in
