"""The cost-ordered pick among the nodes admission allows: cost.py's numbers
over the hub's node handles, and what it learns from each answer.

Theory of operation. Plain synchronous code, called by admission.py's `Place` for an
arriving request and for a queued one granted its place alike: admission has already
said the request may go (classes, reserve, per-key limits exact); this only says where.
Affinity (affinity.py) still says what the request's key is and how it was placed
(`route.reason`, counted); with `Router__Affinity=off`, or a request with nothing to key
on, admission's spread applies as before and nothing here runs.

- Candidates: the model's ready nodes not yet tried. A node without concurrency left is a
  candidate only for a home wait (it is never sent past its `max_concurrency`).
- Order: by cost, cheapest first, ties in rendezvous order on the key (the same on every
  hub). Where no node holds any of the prompt nothing here decides: affinity.py's bounded
  rendezvous spreads it (a free node first), so new keys never pile on the fastest node.
  One candidate is not ranked: there is nothing to order and nowhere else to wait.
- `learn`: an answer's send -> end and send -> first byte, the engine's cached tokens, and
  the node that holds the session's prompt now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.hub.decide import cost
from appliance.hub.decide.affinity import (
    BYTES_PER_TOKEN,
    PREFIX,
    SESSION,
    SPREAD,
    Affinity,
    Route,
    rendezvous,
)
from appliance.hub.decide.home import HomeQueues
from appliance.wire import NodeState


class Node(Protocol):
    """A node handle as the pick reads it (hub/fleet/nodes.NodeHandle)."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> NodeState | None: ...
    @property
    def in_flight_total(self) -> int: ...
    @property
    def others_total(self) -> int: ...
    def places_left(self, model: str) -> int | None: ...
    def has_concurrency(self) -> bool: ...


def places_of(st: NodeState | None, model: str) -> int | None:
    """A node's places for one model: the lesser of its slots and its concurrency."""
    if st is None:
        return None
    bounds = [b for b in (st.model_slots(model), st.max_concurrency) if b is not None]
    return min(bounds) if bounds else None


def free_of(h: Node, model: str) -> int | None:
    """Places left for `model` on `h` as the cost sees them: the hub's count, or the
    engine's own busy slots where it says more are taken (load from outside the hub); a
    node without concurrency left has none."""
    left = h.places_left(model)
    st = h.state
    m = st.model(model) if st is not None else None
    slots = st.model_slots(model) if st is not None and m is not None else None
    if m is not None and m.busy is not None and slots is not None:
        engine = slots - m.busy  # vLLM's busy counts its waiting too: below zero then
        left = engine if left is None else min(left, engine)
    if not h.has_concurrency():
        left = min(0, left or 0)
    return left


@dataclass(slots=True)
class Choice:
    node: str
    home_wait: float  # seconds to wait there for a place (0: send now)


class CostRouter:
    """Rates and session homes learned, home waits held, and the pick."""

    def __init__(self, home_wait: float) -> None:
        self.home_wait = home_wait  # Router__HomeWaitSeconds
        self.rates = cost.Rates()
        self.homes: dict[str, cost.Homes] = {}
        self.queues = HomeQueues()

    def homes_of(self, model: str) -> cost.Homes:
        h = self.homes.get(model)
        if h is None:
            h = self.homes[model] = cost.Homes()
        return h

    def choose(self, model: str, route: Route, nodes: Sequence[Node],
               affinity: Affinity, may_wait: bool = True) -> Choice | None:
        """The node for `route` (None: no candidate; the caller spreads). Fills the route's
        reason, node, matched and predicted figures; counts the reason."""
        if not nodes or (route.session is None and not route.chain):
            return None
        held: dict[str, int] = {}
        seqs: dict[str, tuple[int, int]] = {}
        if route.session is not None:
            home = self.homes_of(model).get(route.session)
            if home is not None:
                held[home[0]] = home[1]
        else:
            seqs = cost.prefix_held(affinity.index.get(model), route.chain)
            held = {n: b * affinity.block // BYTES_PER_TOKEN for n, (b, _) in seqs.items()}
        if not any(held.get(h.name, 0) for h in nodes):
            return None  # nothing cached anywhere: affinity's bounded rendezvous spreads it
        bound = 0.0
        if len(nodes) == 1:
            # One candidate: nothing to rank, and a home wait needs another node with room.
            if not nodes[0].has_concurrency():
                return None
            name = nodes[0].name
        else:
            best, bound = self._rank(model, route, nodes, held, may_wait)
            if best is None:
                return None
            name = best.name
            route.predicted = (best.wait, best.prefill)
        stats = affinity.stats(model)
        top = max(held, key=held.__getitem__, default="")
        if top and held[top] > 0 and name != top:
            stats.moved += 1
        route.matched = route.entry_seq = 0
        if route.session is not None:
            reason = SESSION
        elif held.get(name, 0) > 0:
            reason = PREFIX
            route.matched, route.entry_seq = seqs[name]
        else:
            reason = SPREAD
        route.reason, route.node = reason, name
        setattr(stats, reason, getattr(stats, reason) + 1)
        return Choice(name, bound)

    def _rank(self, model: str, route: Route, nodes: Sequence[Node], held: dict[str, int],
              may_wait: bool) -> tuple[cost.Option | None, float]:
        """The cheapest of several candidates, and how long to wait there for a place."""
        key = route.session if route.session is not None else route.chain[0].to_bytes(8, "little")
        by = {h.name: h for h in nodes}
        options = [cost.Option(n, free_of(by[n], model), places_of(by[n].state, model),
                               held.get(n, 0), self.rates.get(n, model))
                   for n in rendezvous(key, list(by))]
        prompt = max(cost.prompt_tokens(route.size), max(held.values(), default=0))
        ranked = cost.score(options, prompt)
        bound = cost.home_wait(ranked, self.home_wait) if may_wait else 0.0
        if bound > 0:
            return ranked[0], bound
        # no waiting in the hub: a place where one is left, else the engines' queues
        sendable = [o for o in ranked if by[o.name].has_concurrency()]
        return next((o for o in sendable if o.free is None or o.free > 0),
                    sendable[0] if sendable else None), 0.0

    def learn(self, model: str, route: Route, node: str, *, service_s: float | None,
              first_s: float | None) -> None:
        """`node` answered `route`: its rates, and the session's home (what it holds now)."""
        uncached = None
        if route.prompt_tokens is not None and route.cached_tokens is not None:
            uncached = route.prompt_tokens - route.cached_tokens
        self.rates.observe(node, model, service_s=service_s, first_s=first_s, uncached=uncached)
        if route.session is not None:
            tokens = route.prompt_tokens if route.prompt_tokens is not None \
                else cost.prompt_tokens(route.size)
            self.homes_of(model).record(route.session, node, tokens)

    def forget_node(self, node: str) -> None:
        self.rates.forget_node(node)

    def load_of(self, h: Node, model: str) -> dict[str, Any]:
        """What status shows of `model` on `h`: its places (`slots`), the engine's busy
        slots (None: it does not say), the predicted wait for a place there (ms), and the
        requests waiting there for their home now."""
        st = h.state
        m = st.model(model) if st is not None else None
        wait = cost.wait_s(free_of(h, model), places_of(st, model),
                           self.rates.get(h.name, model).service)
        return {"slots": st.model_slots(model) if st is not None else None,
                "busy": m.busy if m is not None else None,
                "predicted_wait_ms": round(wait * 1000, 1),
                "home_waiting": self.queues.waiting(h.name, model)}

    def model_wait(self, model: str, nodes: Sequence[Node], queued: int) -> float:
        """A request's predicted wait for a place of `model` now: the shortest over its
        ready nodes, plus the hub's queue ahead of it at the mean service time over every
        place (demand.py's measure)."""
        if not nodes:
            return 0.0
        waits, places, service = [], 0, 0.0
        for h in nodes:
            rate = self.rates.get(h.name, model)
            n = places_of(h.state, model)
            waits.append(cost.wait_s(free_of(h, model), n, rate.service))
            places += n or 1
            service += rate.service
        return min(waits) + queued * (service / len(nodes)) / max(1, places)
