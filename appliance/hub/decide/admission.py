"""Admission: may this request go now, or must it wait? The trio shell of `priority.py`.

Owns the waiting: every decision is made by the synchronous cores (`AdmissionCore`,
`SlotQueues`, `HomeQueues`, `Shares`); a request that must wait gets a `trio.Event`, set
when the registry reports a change (`_on_change`; `_wake_waiters` alone when a request
finishes) and the core says it may go -- no polling, each wait bounded from
configuration at the call site. A waiter whose client hangs up leaves at once; a place it
was granted goes to the next. Running work is never touched.

A request's place is one `async with admission.place(...) as p` (place.py): admitted on
entry (or ApiError: queue_full, queue_timeout, priority_wait_timeout), then on one node at
a time, picked and counted in flight without a checkpoint after admission; affinity's key
is made here from the request's `Prompt`, and what the node answered (`Place.served`)
teaches affinity and the cost rates when the place is given back. Also: `wait_slot`
(Queue__SlotWaitSeconds), `status_block()` for /api/status, `reload(cfg)`. Its series are
read by hub/observe/queue_metrics.py: nothing here imports prometheus_client.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from appliance.config import Config
from appliance.hub.decide import priority
from appliance.hub.decide.affinity import Affinity, Candidate, Route
from appliance.hub.decide.cost import CostRouter, places_of
from appliance.hub.decide.demand import ReplicaDemand
from appliance.hub.decide.fair import Demand
from appliance.hub.decide.home import CANCELLED, HOME, MOVED, SENT
from appliance.hub.decide.lanes import RANK
from appliance.hub.decide.place import Gauge, Place, Prompt, Ticket
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
from appliance.hub.decide.slots import SlotQueues
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


class Admission:
    def __init__(self, cfg: Config, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.core = AdmissionCore(**_settings(cfg))
        self.slots = SlotQueues()
        self.enabled = cfg.priority.enabled
        self.slot_wait = cfg.queue.slot_wait_seconds
        self.preempt = cfg.priority.enabled and cfg.priority.preempt
        self.victims = Victims()  # background requests holding a place (preempt.py)
        self.reserve_problem = ""  # Priority__ReserveSlots >= the fleet's places (status)
        # The fleet's shape (a node's state, its connection, its cordon) the reserve was
        # last checked against.
        self._shape: list[tuple[NodeHandle, NodeState | None, bool, bool]] = []
        # Which of the nodes it may go to a request goes to (affinity.py, cost.py).
        self.affinity = Affinity(**_affinity(cfg))
        self.cost = CostRouter(cfg.router.home_wait_seconds)
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
        self.slot_wait = cfg.queue.slot_wait_seconds
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
        p._take()  # no checkpoint since admit returned: this place is ours
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
            p._give_back()  # a node given back wakes the waiters (Registry.finish)
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
        if self.slots.queues:
            for node, model in self.slots.keys():
                self._dispatch_slots(node, model)
        if self.cost.queues.queues:
            for node, model in self.cost.queues.keys():
                self._dispatch_home(node, model)

    # --- home waits (home.py) ------------------------------------------------------------

    async def wait_home(self, p: Place) -> None:
        """Hold `p` on its node (counted in flight there) until a place frees, at most
        `p.home` seconds; then it moves to the cheapest other node that can take it."""
        node, bound, route = p.node, p.home, p.route
        assert node is not None
        p.home = 0.0
        predicted = route.predicted[0] if route is not None and route.predicted else 0.0
        queues = self.cost.queues
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
            p._give_back()
            p._take(may_wait=False)  # anywhere but home
            if p.node is None:  # nowhere else: back home, sent anyway (its engine queues)
                outcome = SENT
                self.registry.start(node, p.model)
                if p._in_flight is not None:
                    p._in_flight.inc()
                p.node = node
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
        for w in self.cost.queues.dispatch(name, model, free, routable):
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
