"""Admission: may this request go now, or must it wait -- and its place once it may.

Owns the capacity queue's waiting, the trio shell of priority.py: every decision is made
by the synchronous cores (`AdmissionCore`, `Shares`); a request that must wait gets a
`trio.Event`, set when the registry reports a change (`_on_change`; `_wake_waiters` alone
when a request finishes) and the core says it may go -- no polling, each wait bounded from
configuration. A waiter whose client hangs up leaves at once; a place it was granted goes
to the next. Running work is never touched. Waits on one node (slot, home): waits.py.

A request's place is one `async with admission.place(...) as p` (`Place`): admitted on
entry (or ApiError: queue_full, queue_timeout, priority_wait_timeout), then on one node at
a time, picked and counted in flight without a checkpoint after admission; affinity's key
is made here from the request's `Prompt`, and what the node answered (`Place.served`)
teaches affinity and the cost rates when the place is given back. Its series are read by
hub/observe/queue_metrics.py: nothing here imports prometheus_client.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple, Protocol

import trio

from appliance.config import Config
from appliance.hub.decide import priority
from appliance.hub.decide.affinity import Affinity, Candidate, Route
from appliance.hub.decide.cost import CostRouter, places_of
from appliance.hub.decide.demand import ReplicaDemand
from appliance.hub.decide.fair import Demand, FairLane
from appliance.hub.decide.lanes import RANK
from appliance.hub.decide.preempt import Preemptible, Victims
from appliance.hub.decide.priority import (
    BACKGROUND,
    ESSENTIAL,
    NORMAL,
    AdmissionCore,
    Fleet,
    count,
)
from appliance.hub.decide.share import Shares
from appliance.hub.decide.shared import Fold
from appliance.hub.decide.waits import NodeWaits
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.wire import NodeState

log = logging.getLogger(__name__)


def _settings(cfg: Config) -> dict[str, Any]:
    return dict(enabled=cfg.priority.enabled, reserve=cfg.priority.reserve_slots,
                essential=cfg.priority.essential_slots,
                max_depth=cfg.queue.max_depth, max_wait=cfg.queue.max_wait_seconds,
                background_max_wait=cfg.priority.background_max_wait_seconds)


def slot_overrides(cfg: Config) -> dict[str, int]:
    """`Models__N__Slots`: a model's places per node, over what its engines say."""
    return {m.name: m.slots for m in cfg.models.items if m.slots is not None}


def _affinity(cfg: Config) -> dict[str, Any]:
    r = cfg.router
    return dict(enabled=r.affinity == "on", factor=r.affinity_load_factor,
                entries=r.affinity_index_entries, block=r.affinity_block_chars)


class Prompt(NamedTuple):
    """What affinity keys a request on: its decoded body, its headers, its size in bytes."""

    body: dict[str, Any]
    headers: Iterable[tuple[bytes, bytes]]
    size: int


class Gauge(Protocol):
    """A gauge's child (prometheus_client): the in-flight count of one model."""

    def inc(self, amount: float = 1) -> None: ...
    def dec(self, amount: float = 1) -> None: ...


@dataclass(slots=True, eq=False)
class Place:
    """A request's place: the node it is on now (`node`, counted in flight) and the
    nodes it was on (`tried`). Made by `Admission.place`."""

    _admission: Admission
    model: str
    cls: str
    _in_flight: Gauge | None  # the appliance_in_flight gauge's child for `model`
    ticket: Ticket
    route: Route | None = None  # the affinity key admission made (None: none)
    node: NodeHandle | None = None
    tried: list[str] = field(default_factory=list)
    home: float = 0.0  # seconds to wait on `node` for a place there (cost.py), 0: none
    sent_at: float = 0.0  # time.perf_counter() when it went to its node
    clean: bool = False  # it went with a place (its time is the node's service time)
    # (first byte's time.perf_counter(), the engine's (prompt, cached) tokens) once
    # `node` answered (`served`)
    _served: tuple[float | None, tuple[int, int] | None] | None = None

    def served(self, first_at: float | None, cache: tuple[int, int] | None) -> None:
        """Its node answered (200): `first_at`, time.perf_counter() of the first byte;
        `cache`, (prompt, cached) tokens as the engine reported them, if it did. Affinity's
        index and the cost's rates learn it when the place is given back."""
        self._served = (first_at, cache)

    def take(self, may_wait: bool = True) -> None:
        """Take the best node for it now (`node`; None: none can take it), counted there."""
        registry = self._admission.registry
        node, self.home = self._admission.pick(self.model, self.route, self.tried, may_wait)
        if node is not None:
            self.tried.append(node.name)
            registry.start(node, self.model)
            if self._in_flight is not None:
                self._in_flight.inc()
        self.node = node

    def give_back(self) -> None:
        """Give its node back (if any): uncounted there, the waiters told."""
        node, self.node = self.node, None
        if node is not None:
            demand = self._admission.demand
            if demand is not None and self.model in demand.follows:
                demand.used(node.name, self.model, trio.current_time())
            if self._in_flight is not None:
                self._in_flight.dec()
            self._admission.registry.finish(node, self.model)

    def back_to(self, node: NodeHandle) -> None:
        """Counted on `node` again: a home wait ran out with nowhere else to go."""
        self._admission.registry.start(node, self.model)
        if self._in_flight is not None:
            self._in_flight.inc()
        self.node = node

    async def wait_slot(self) -> None:
        """Hold it for a place on its home node while that pays (home.py); then hold a
        non-essential request while its node's slots for the model are all sent."""
        if self.node is not None and self.home > 0:
            await self._admission.waits.wait_home(self)
        if self.node is not None:
            waits = self._admission.waits
            if waits.slot_wait > 0 and self.cls != ESSENTIAL:
                await waits.wait_slot(self.node, self.model, self.cls)
            left = self.node.places_left(self.model)
            self.clean = left is None or left >= 0
        self.sent_at = time.perf_counter()

    def next(self, max_attempts: int) -> NodeHandle | None:
        """Give the current node back; take the next other (None: none left, or
        `max_attempts` nodes tried)."""
        self.give_back()
        if len(self.tried) < max_attempts:
            self.take()
        return self.node


@dataclass(slots=True)
class Ticket:
    """The admission a request was granted."""

    model: str
    cls: str
    client: str
    waited: bool = False
    fair: tuple[FairLane, int] | None = None  # the lane and episode it was charged in


class Admission:
    def __init__(self, cfg: Config, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.core = AdmissionCore(**_settings(cfg))
        self.enabled = cfg.priority.enabled
        self.preempt = cfg.priority.enabled and cfg.priority.preempt
        self.victims = Victims()  # background requests holding a place (preempt.py)
        self.reserve_problem = ""  # Priority__ReserveSlots >= the fleet's places (status)
        # The fleet's shape (a node's state, its connection, its cordon) the reserve was
        # last checked against.
        self._shape: list[tuple[NodeHandle, NodeState | None, bool, bool]] = []
        # Which of the nodes it may go to a request goes to (affinity.py, cost.py).
        self.affinity = Affinity(**_affinity(cfg))
        self.cost = CostRouter(cfg.router.home_wait_seconds)
        # Slot and home waits on one node (waits.py).
        self.waits = NodeWaits(registry, self.cost.queues, cfg.queue.slot_wait_seconds)
        self.slots = self.waits.slots
        registry.set_slot_overrides(slot_overrides(cfg))
        # Replicas that follow demand (demand.py): the control plane's, set by the hub.
        self.demand: ReplicaDemand | None = None
        # A place kept back for the other keys of a class (share.py): only where there are
        # other keys (Auth__Clients); a hub of one tenant has nothing to keep back.
        self.shares = Shares()
        self._share_keys(cfg)
        registry.add_listener(self._on_change, on_finish=self._wake_waiters)
        # Where the other hubs (HA) sent sessions and prompts, as the nodes say (shared.py).
        self.shared = Fold(self.cost.homes_of, self.affinity.index_of, self.cost.rates)
        registry.state_listeners.append(self._fold)

    def reload(self, cfg: Config) -> None:
        """New settings apply to new waiters; one that waits keeps its bound."""
        self.cfg = cfg
        self.core.configure(**_settings(cfg))
        self.affinity.configure(**_affinity(cfg))
        self.cost.home_wait = cfg.router.home_wait_seconds
        self.registry.set_slot_overrides(slot_overrides(cfg))
        self.enabled = cfg.priority.enabled
        self.waits.slot_wait = cfg.queue.slot_wait_seconds
        self.preempt = cfg.priority.enabled and cfg.priority.preempt
        self._check_reserve()  # the reserve or the essential places may have changed
        self._share_keys(cfg)
        self._on_change()

    # --- the capacity queue and the reserve ----------------------------------------------

    async def admit(self, model: str, cls: str, client: str, cost: int = 0,
                    weight: float = 1.0) -> Ticket:
        core = self.core
        ready = self.registry.ready_nodes(model)
        if self.core.share is not None:
            self.shares.arrive(model, cls if self.enabled else NORMAL, client, weight,
                               trio.current_time())
        w = core.arrive(model, cls, client, partial(count, ready, model), cost, weight)
        if w is None:
            return Ticket(model, cls, client)
        w.event = woken = trio.Event()
        self._dispatch(model)
        if not w.granted and w.cls == ESSENTIAL and self.preempt:
            self.victims.preempt_one(model)
        if not w.granted:
            try:
                limit = trio.current_time() + core.wait_limit(w)
                while not w.granted and trio.current_time() < limit:
                    with trio.move_on_at(min(limit, self._quiet_at(model, w.cls))):
                        await woken.wait()
                    if not w.granted and trio.current_time() < limit:
                        self._dispatch(model)  # a key went quiet: its kept place is free
            except BaseException:
                # Cancelled (the client hung up): out of the queue now, grant passed on.
                if core.leave(w, timed_out=False):
                    if self.shares.groups:
                        self.shares.release(model, w.cls, client, trio.current_time())
                    self._dispatch(model)
                raise
        if w.granted:
            core.started(w)
            return Ticket(model, w.cls, client, waited=True, fair=w.fair)
        core.leave(w, timed_out=True)
        raise core.timeout_error(w)

    @asynccontextmanager
    async def place(self, model: str, cls: str, client: str, in_flight: Gauge | None = None,
                    demand: Demand | None = None,
                    prompt: Prompt | None = None,
                    victim: Preemptible | None = None, *,
                    route: Route | None = None) -> AsyncIterator[Place]:
        """Admit, then take the best node for `model` (`Place.node`, None when no node can
        take it); the node is given back on any exit, a fair-queue charge settled from
        `demand.used`, and affinity told where it was served (`Place.served`).
        `prompt`: the request's body, headers and size, affinity's key is made from (None:
        no key; `route`: one made already). `victim`: the request itself, which essential work
        may preempt while it is background and has no first byte (Priority__Preempt)."""
        if demand is None:
            ticket = await self.admit(model, cls, client)
        else:
            ticket = await self.admit(model, cls, client, demand.cost, demand.weight)
        if prompt is not None:
            route = self.affinity.key(prompt.body, prompt.headers)
            route.size = prompt.size
        p = Place(self, model, cls, in_flight, ticket, route)
        p.take()  # no checkpoint since admit returned: this place is ours
        if self.demand is not None and model in self.demand.follows:  # demand.py
            ms = self.core.models.get(model)
            self.demand.observe(model, self.cost.model_wait(
                model, self.registry.ready_nodes(model), ms.waiting if ms is not None else 0),
                trio.current_time())
        if p.home:  # it waits for its home node: the place it was granted goes on
            self._dispatch(model)
        held = victim if self.preempt and ticket.cls == BACKGROUND else None
        if held is not None:
            self.victims.hold(model, held)
        try:
            yield p
        finally:
            if held is not None:
                self.victims.release(model, held)
            if p.route is not None and p._served is not None and p.node is not None:
                # Its node answered: affinity's index and the cost's rates learn from it
                # (`first_at`: time.perf_counter() of its first byte; `cache`: the engine's
                # (prompt, cached) tokens, if it said).
                route, (first_at, cache) = p.route, p._served
                if cache is not None:
                    route.prompt_tokens, route.cached_tokens = cache
                self.affinity.served(model, route, p.node.name)
                sent, now = p.sent_at, time.perf_counter()
                self.cost.learn(model, route, p.node.name,
                                service_s=now - sent if p.clean and sent else None,
                                first_s=first_at - sent if first_at is not None and sent
                                else None)
            took = p.node is not None
            p.give_back()  # a node given back wakes the waiters (Registry.finish)
            if self.shares.groups:
                self.shares.release(model, cls if self.enabled else NORMAL, client,
                                    trio.current_time())
            if self.shares.groups or not took:
                self._wake_waiters()  # a place kept back for others may be its key's again
            if ticket.fair is not None and demand is not None and demand.used is not None:
                lane, episode = ticket.fair
                lane.settle(client, episode, demand.cost, demand.used, demand.weight)

    def pick(self, model: str, route: Route | None, tried: list[str],
             may_wait: bool = True) -> tuple[NodeHandle | None, float]:
        """The node for the next attempt, and how long to wait there for a place (0: none):
        the registry's pick among the nodes it would consider, ordered by cost (cost.py)
        when the request has a route."""
        registry = self.registry
        if route is None or not self.affinity.enabled:
            self.affinity.spread(model)
            return registry.pick(model, exclude=set(tried)), 0.0
        ready = registry.ready_nodes(model)
        if tried:
            ready = [h for h in ready if h.name not in tried]
        choice = self.cost.choose(model, route, ready, self.affinity, may_wait)
        if choice is not None:
            for h in ready:
                if h.name == choice.node:
                    return h, choice.home_wait
        return self._affinity_pick(model, route, tried), 0.0

    def _affinity_pick(self, model: str, route: Route, tried: list[str]) -> NodeHandle | None:
        registry = self.registry
        # At its limit: no place left for the model (its slots or its concurrency). Such
        # a node still takes work from the pick when every node is (its engine queues it).
        nodes = [h for h in registry.ready_nodes(model)
                 if h.name not in tried and h.has_concurrency()]
        cands = []
        for h in nodes:
            left = h.places_left(model)
            # The load bound weighs this hub's own requests: other hubs' (HA) arrive a
            # heartbeat late, and a stale count would move a session they keep home.
            own = h.in_flight_total - h.others_total
            cands.append(Candidate(h.name, own, left is not None and left <= 0))
        name = self.affinity.choose(model, route, cands)
        if name is not None:
            return next(h for h in nodes if h.name == name)
        return registry.pick(model, exclude=set(tried))

    def _share_keys(self, cfg: Config) -> None:
        self.core.share = self._share if cfg.auth.clients else None

    def _quiet_at(self, model: str, cls: str) -> float:
        """When a place kept back for a quiet key frees for the others (inf: never)."""
        if self.core.share is None:
            return math.inf
        t = self.shares.quiet_at(model, cls if self.enabled else NORMAL, trio.current_time())
        return math.inf if t is None else t

    def _fold(self, h: NodeHandle, st: NodeState) -> None:
        self.shared.state(h.name, st)

    def _share(self, model: str, cls: str, client: str) -> bool:
        """share.py's rule for the core: may `client` take one more place of `model`?"""
        total: int | None = 0
        for h in self.registry.ready_nodes(model):
            n = places_of(h.state, model)
            total = None if n is None or total is None else total + n
        q = self.core.queues.get(model)
        waiting = q.lanes[RANK[cls]].backlog() if q is not None else {}
        return self.shares.take(model, cls, client, total, trio.current_time(), waiting)

    def fleet(self, model: str) -> Fleet:
        return count(self.registry.ready_nodes(model), model)

    def _dispatch(self, model: str) -> None:
        for w in self.core.dispatch(model, self.fleet(model)):
            if w.event is not None:
                w.event.set()

    def _on_change(self) -> None:
        shape = [(h, h.state, h.connected, h.cordoned) for h in self.registry.nodes.values()]
        if shape != self._shape:
            self._shape = shape
            self._check_reserve()
        self._wake_waiters()

    def _check_reserve(self) -> None:
        """A reserve the whole fleet cannot exceed starves background work: said once per
        change in the log (as the fleet becomes known after a start) and in /api/status."""
        if not self.enabled:
            return
        caps = [h.state.max_concurrency for h in self.registry.nodes.values()
                if h.connected and h.state is not None and not h.removed]
        why = priority.reserve_warning(self.core.reserve, caps, self.core.essential)
        if why and why != self.reserve_problem:
            log.warning("%s", why)
        self.reserve_problem = why

    def _wake_waiters(self) -> None:
        """Whoever may go now goes (every change; a finished request changes no shape)."""
        if self.core.queues:
            for model in self.core.waiting_models():
                self._dispatch(model)
        if self.slots.queues or self.cost.queues.queues:
            self.waits.wake()

    # --- visibility ----------------------------------------------------------------------

    def status_block(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        out: dict[str, Any] = {"reserve_slots": self.core.reserve,
                     "background_max_wait_seconds": self.core.background_max_wait}
        for c, s in self.core.classes.items():
            out[c] = s.as_dict()
        if self.preempt:
            out["preempted"] = self.victims.preempted
        if self.reserve_problem:
            out["warning"] = self.reserve_problem
        return out

    def statistics(self) -> dict[str, Any]:
        return self.core.statistics()

    def waiting(self, model: str) -> int:
        """Requests waiting for a place for `model` now (one arriving queues behind them)."""
        s = self.core.models.get(model)
        return s.waiting if s is not None else 0
