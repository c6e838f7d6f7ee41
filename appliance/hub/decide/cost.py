"""Cost: which of the nodes admission allows gives a request its first token soonest.

Owns one number per request and node, the expected time to its first token -- the wait
for a place there plus the prefill of the prompt tokens it does not hold -- the rates
behind it, and `CostRouter`'s pick and learning over the hub's node handles. It only ORDERS
the nodes admission allows (admission alone says whether a request may go), and must not
do I/O, read a clock or sleep: durations come in. With `Router__Affinity=off`, or a
request with nothing to key on, admission's spread applies and nothing here runs.
- wait: the requests ahead there (beyond its places, home waits included) at the node's
  service time for the model, over its places; none while a place is left or unbounded.
- prefill: (prompt tokens - tokens held there) / the node's prefill rate. Held: the
  session's last answer there (`Homes`), else the longest prefix affinity's index saw
  served there (read, never written here). Nothing held anywhere: affinity's bounded
  rendezvous spreads it, so new keys never pile on the fastest node.
- `Rates`: an EWMA per node and model from the hub's own clock (send -> end, send -> first
  byte over the uncached tokens), bounded by caps: a lying engine is not trusted past them.
Ties keep the rendezvous order. A request whose cheapest node is full waits there (a home
wait, home.py) while it holds the prompt and the prefill it skips beats the predicted
wait; at most `Router__HomeWaitSeconds`, then it moves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.hub.decide.affinity import (
    BYTES_PER_TOKEN,
    PREFIX,
    SESSION,
    SPREAD,
    Affinity,
    PrefixIndex,
    Route,
    prompt_tokens,
    rendezvous,
)
from appliance.hub.decide.fit import Node
from appliance.hub.decide.home import HomeQueues
from appliance.wire import NodeState

log = logging.getLogger(__name__)

# Before a node has answered: a short chat's end-to-end time and a 7-8B model's prefill on
# one consumer GPU (the sim's default, Sim__PrefillTokensPerSecond=4000, halved).
DEFAULT_SERVICE_S = 2.0
DEFAULT_PREFILL_TPS = 2000.0
# Weight of the newest sample in the moving averages: ~5 answers to follow a change.
EWMA = 0.2
# What is believed at most: an hour per request, a million tokens a second of prefill
# (no engine today is within 10x of either); below, a millisecond and one token a second.
SERVICE_S_BOUNDS = (0.001, 3600.0)
PREFILL_TPS_BOUNDS = (1.0, 1_000_000.0)
# A first byte after fewer uncached tokens than this says more about the network than the
# prefill rate: not learned from.
MIN_PREFILL_SAMPLE = 32
# Sessions remembered per model (session -> node that answered last, its prompt tokens).
HOME_ENTRIES = 100_000


@dataclass(slots=True)
class Rate:
    service: float = DEFAULT_SERVICE_S  # seconds from send to the end of the answer
    prefill: float = DEFAULT_PREFILL_TPS  # uncached prompt tokens per second
    answers: int = 0


def _bounded(value: float, bounds: tuple[float, float], what: str, warned: set[str]) -> float:
    lo, hi = bounds
    if lo <= value <= hi:
        return value
    if what not in warned:  # once per kind of nonsense, not once per answer
        warned.add(what)
        log.warning("%s %.6g is out of bounds %g..%g: bounded (said once)", what, value, lo, hi)
    return min(hi, max(lo, value))


class Rates:
    """Observed service time and prefill rate per (node, model)."""

    def __init__(self) -> None:
        self.by: dict[tuple[str, str], Rate] = {}
        self.warned: set[str] = set()

    def get(self, node: str, model: str) -> Rate:
        """The node's rates; a node not heard from yet is taken to be like the model's
        other nodes (their mean), else the defaults -- never faster than what is known."""
        r = self.by.get((node, model))
        if r is not None:
            return r
        known = [x for (_, m), x in self.by.items() if m == model]
        if not known:
            return Rate()
        return Rate(sum(x.service for x in known) / len(known),
                    sum(x.prefill for x in known) / len(known))

    def observe(self, node: str, model: str, *, service_s: float | None,
                first_s: float | None, uncached: int | None) -> None:
        """One answer: its time from send to end (None: not a clean sample, e.g. it waited
        in the engine's own queue), to its first byte, and the prompt tokens the engine
        said it computed."""
        r = self.by.get((node, model))
        if r is None:
            r = self.by[(node, model)] = Rate()
        first = r.answers == 0
        r.answers += 1
        if service_s is not None:
            s = service_s
            if not SERVICE_S_BOUNDS[0] <= s <= SERVICE_S_BOUNDS[1]:
                s = _bounded(s, SERVICE_S_BOUNDS, "service time (s)", self.warned)
            r.service = s if first else (1 - EWMA) * r.service + EWMA * s
        if first_s is not None and first_s > 0 and uncached is not None \
                and uncached >= MIN_PREFILL_SAMPLE:
            tps = _bounded(uncached / first_s, PREFILL_TPS_BOUNDS, "prefill rate (tokens/s)",
                           self.warned)
            r.prefill = tps if r.prefill == DEFAULT_PREFILL_TPS else \
                (1 - EWMA) * r.prefill + EWMA * tps

    def hint(self, node: str, model: str, service_s: float) -> None:
        """The node's own word on its service time (several hubs): taken until this hub has
        an answer of its own from there, never after."""
        r = self.by.get((node, model))
        if r is not None and r.answers > 0:
            return
        s = _bounded(service_s, SERVICE_S_BOUNDS, "a node's service time (s)", self.warned)
        if r is None:
            self.by[(node, model)] = Rate(service=s)
        else:
            r.service = s

    def forget_node(self, node: str) -> None:
        for k in [k for k in self.by if k[0] == node]:
            del self.by[k]


class Homes:
    """Session -> (the node that answered it last, its prompt tokens then): least recently
    used first out."""

    def __init__(self, capacity: int = HOME_ENTRIES) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[bytes, tuple[str, int]] = OrderedDict()

    def get(self, session: bytes) -> tuple[str, int] | None:
        return self.entries.get(session)

    def record(self, session: bytes, node: str, tokens: int) -> None:
        self.entries[session] = (node, tokens)
        self.entries.move_to_end(session)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


def prefix_held(index: PrefixIndex | None, chain: list[int]) -> dict[str, tuple[int, int]]:
    """Per node, (blocks of `chain` it is known to hold, the index entry's order): the
    longest prefix the index saw served there, not yet evicted."""
    out: dict[str, tuple[int, int]] = {}
    if index is None:
        return out
    entries, mark = index.entries, index.watermark
    for i in range(len(chain) - 1, -1, -1):
        e = entries.get(chain[i])
        if e is None:
            continue
        node, seq = e
        if node not in out and seq > mark.get(node, 0):
            out[node] = (i + 1, seq)
    return out


@dataclass(slots=True)
class Option:
    """A node admission allows, as cost sees it: its places left for the model before
    this request (None: unbounded), its places, the prompt tokens it holds, its rates."""

    name: str
    free: int | None
    places: int | None
    held: int
    rate: Rate
    wait: float = 0.0
    prefill: float = 0.0

    @property
    def cost(self) -> float:
        return self.wait + self.prefill


def wait_s(free: int | None, places: int | None, service: float) -> float:
    """Expected wait for a place: none while one is left; else the requests ahead (the
    `-free` beyond its places, and this one) at `service` seconds over the places."""
    if free is None or free > 0:
        return 0.0
    return (1 - free) * service / max(1, places or 1)


def score(options: Sequence[Option], prompt: int) -> list[Option]:
    """Each option's wait and prefill filled in; cheapest first, ties in the given order."""
    for o in options:
        o.wait = wait_s(o.free, o.places, o.rate.service)
        o.prefill = max(0, prompt - o.held) / o.rate.prefill
    return sorted(options, key=lambda o: o.cost)  # stable: ties keep rendezvous order


def home_wait(ranked: Sequence[Option], limit: float) -> float:
    """How long the cheapest option's request waits there for a place before it moves (0:
    it does not wait). It waits when that node is full, holds some of the prompt, and the
    prefill it saves against the cheapest node with a place left beats the predicted wait;
    at most `limit` (Router__HomeWaitSeconds) and the saving itself. No node with a place
    left: no wait in the hub either -- the engine's own queue there is the same wait."""
    if not ranked or limit <= 0:
        return 0.0
    best = ranked[0]
    if best.free is None or best.free > 0 or best.held <= 0:
        return 0.0
    free = next((o for o in ranked if o.free is None or o.free > 0), None)
    if free is None:
        return 0.0
    saving = free.prefill - best.prefill
    if saving <= best.wait:
        return 0.0
    return min(limit, saving)


def names(options: Iterable[Option]) -> list[str]:
    return [o.name for o in options]


# --- the pick over the hub's node handles ------------------------------------------------


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
        self.rates = Rates()
        self.homes: dict[str, Homes] = {}
        self.queues = HomeQueues()

    def homes_of(self, model: str) -> Homes:
        h = self.homes.get(model)
        if h is None:
            h = self.homes[model] = Homes()
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
            seqs = prefix_held(affinity.index.get(model), route.chain)
            for n, (blocks, _) in seqs.items():
                held[n] = blocks * affinity.block // BYTES_PER_TOKEN
        for h in nodes:
            if held.get(h.name, 0):
                break
        else:
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
        stats = route.stats = affinity.stats(model)
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
              may_wait: bool) -> tuple[Option | None, float]:
        """The cheapest of several candidates, and how long to wait there for a place."""
        key = route.session if route.session is not None else route.chain[0].to_bytes(8, "little")
        by = {h.name: h for h in nodes}
        options = [Option(n, free_of(by[n], model), places_of(by[n].state, model),
                               held.get(n, 0), self.rates.get(n, model))
                   for n in rendezvous(key, list(by))]
        prompt = max(prompt_tokens(route.size), max(held.values(), default=0))
        ranked = score(options, prompt)
        bound = home_wait(ranked, self.home_wait) if may_wait else 0.0
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
                else prompt_tokens(route.size)
            self.homes_of(model).record(route.session, node, tokens)

    def forget_node(self, node: str) -> None:
        self.rates.forget_node(node)

    def load_of(self, h: Node, model: str) -> dict[str, Any]:
        """What status shows of `model` on `h`: its places (`slots`), the engine's busy
        slots (None: it does not say), the predicted wait for a place there (ms), and the
        requests waiting there for their home now."""
        st = h.state
        m = st.model(model) if st is not None else None
        wait = wait_s(free_of(h, model), places_of(st, model),
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
            waits.append(wait_s(free_of(h, model), n, rate.service))
            places += n or 1
            service += rate.service
        return min(waits) + queued * (service / len(nodes)) / max(1, places)
