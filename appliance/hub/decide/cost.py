"""Cost: which node gives a request its first token soonest.

Owns one number per request and node, the expected time to its first token -- the wait
for a place there plus the prefill of the prompt tokens it does not hold -- and the rates
behind it. It only ORDERS the nodes admission allows (admission alone says whether a
request may go), and must not do I/O, read a clock or sleep: durations come in.
- wait: the requests ahead there (beyond its places, home waits included) at the node's
  service time for the model, over its places; none while a place is left or unbounded.
- prefill: (prompt tokens - tokens held there) / the node's prefill rate. Held: the
  session's last answer there (`Homes`), else the longest prefix affinity's index saw
  served there (read, never written here).
- `Rates`: an EWMA per node and model from the hub's own clock (send -> end, send -> first
  byte over the uncached tokens), bounded by caps: a lying engine is not trusted past them.
Ties keep the given (rendezvous) order. A request whose cheapest node is full waits there
(a home wait, `home_wait`) while it holds the prompt and the prefill it skips beats the
predicted wait; at most `Router__HomeWaitSeconds`, then it moves.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from appliance.hub.decide.affinity import BYTES_PER_TOKEN, PrefixIndex

log = logging.getLogger("appliance.hub.decide.cost")

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
            s = _bounded(service_s, SERVICE_S_BOUNDS, "service time (s)", self.warned)
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


def prompt_tokens(size: int) -> int:
    """A request's prompt tokens, predicted from its body's bytes (~4 a token)."""
    return size // BYTES_PER_TOKEN


def names(options: Iterable[Option]) -> list[str]:
    return [o.name for o in options]
