"""Affinity: which of the nodes admission allows should serve a request, so that the
engine there already holds its prompt in its KV cache.

Owns the node order for a request's key: rendezvous hashing with a load bound, the
prefix index per model, the counts per model (reasons `session`, `prefix`, `spread`;
`moved`). Plain synchronous code: no sockets, no trio, no clock. It must not decide
whether a request may go (admission.py does, exactly as without it) nor read the body
(translate/prompt.py makes the key's parts); it only ORDERS the nodes admission would
accept. The rules: `Affinity`'s docstring.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from appliance.hub.translate.prompt import chain_of, render, session_of
from appliance.wire import ROUTE_HEADER

# Bytes per token of English text in the BPE vocabularies of today's models (the usual
# rule of thumb: ~4); converts a matched prefix in bytes to the tokens an engine reports.
BYTES_PER_TOKEN = 4
# A predicted hit is confirmed when the engine reports at least this share of the matched
# prefix as cached (templates and tokenizers make the two numbers differ a little).
CONFIRM_SHARE = 0.5

# Requests a node may run above the mean before the load bound applies: a few more on a
# warm node cost less than a cold prefill (llama-server runs 4 slots by default, Ollama
# up to OLLAMA_NUM_PARALLEL=4); the factor takes over from ~16 requests per node.
BALANCE_SLACK = 4

# The routing key's header to the node, for the other hubs (shared.py reads it back).
HEADER = ROUTE_HEADER.encode()

SESSION, PREFIX, SPREAD = "session", "prefix", "spread"
REASONS = (SESSION, PREFIX, SPREAD)

def _h(data: bytes | memoryview, size: int = 8) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


# --- the key ---------------------------------------------------------------------------


@dataclass(slots=True)
class Route:
    """A request's affinity key and what became of it: `session` (a 16-byte digest) or
    `chain` (block digests as ints); the shell fills `node`, `reason`, `matched` when it
    places the request, and the engine's usage when the answer shows it."""

    session: bytes | None = None
    chain: list[int] = field(default_factory=list)
    reason: str = SPREAD
    node: str = ""
    matched: int = 0  # blocks of the chain the index knew on `node` (a predicted hit)
    entry_seq: int = 0  # the order of the index entry that predicted it
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    size: int = 0  # the request body's bytes: its prompt tokens, predicted (cost.py)
    # cost.py's word (set where it placed the request): predicted wait and prefill, s
    predicted: tuple[float, float] | None = None
    # A wait for its home node (home.py): (predicted s, waited s, outcome)
    home_wait: tuple[float, float, str] | None = None
    # Its model's counts, found where it was placed (`served` counts into them too)
    stats: ModelStats | None = None


def prompt_tokens(size: int) -> int:
    """A request's prompt tokens, predicted from its body's bytes (~4 a token)."""
    return size // BYTES_PER_TOKEN


def note(route: Route | None) -> list[tuple[bytes, bytes]]:
    """The routing-key header for a request placed by `route` (none without a key): the
    other hubs sharing its node fold it into their memory (shared.py)."""
    if route is None:
        return []
    if route.session is not None:
        return [(HEADER, b"s%s,%d" % (route.session.hex().encode(), route.size // BYTES_PER_TOKEN))]
    if route.chain:
        return [(HEADER, b"p%016x" % route.chain[-1])]
    return []


# --- rendezvous with a load bound --------------------------------------------------------


@dataclass(slots=True)
class Candidate:
    """A node admission would send the request to: its name, its requests in flight,
    and whether it is at its limit (no place left for the model: slots or concurrency,
    so a free place elsewhere is used first and the reserve stays exact)."""

    name: str
    in_flight: int
    full: bool = False


def rendezvous(key: bytes, names: Iterable[str]) -> list[str]:
    """`names`, highest random weight first: the same order on every hub, and removing a
    name moves only the keys it was first for."""
    return sorted(names, key=lambda n: _h(key + b"\x00" + n.encode()), reverse=True)


def load_limit(candidates: Sequence[Candidate], factor: float) -> int:
    """The most requests in flight a node may have after taking this one."""
    total = sum(c.in_flight for c in candidates)
    n = len(candidates)
    return max(math.ceil(factor * (total + 1) / n), total // n + BALANCE_SLACK)


def first_within(order: Iterable[str], candidates: Sequence[Candidate],
                 factor: float) -> tuple[str | None, bool]:
    """The first node of `order` within the load bound and not full; (None, _) when none
    is: the caller spreads. The bool says whether the first choice was passed over."""
    by = {c.name: c for c in candidates}
    limit = load_limit(candidates, factor)
    moved = False
    for name in order:
        c = by.get(name)
        if c is None:
            continue
        if not c.full and c.in_flight + 1 <= limit:
            return name, moved
        moved = True
    return None, moved


# --- the prefix index --------------------------------------------------------------------


class PrefixIndex:
    """Block digest -> (node, order written), least recently used first out."""

    __slots__ = ("capacity", "entries", "watermark", "_seq")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.watermark: dict[str, int] = {}  # node -> entries up to this order are gone
        self._seq = 0

    def __len__(self) -> int:
        return len(self.entries)

    def longest(self, chain: list[int], usable: set[str]) -> tuple[int, str, int]:
        """(blocks matched, node, entry order) of the longest prefix of `chain` known on a
        node in `usable`; (0, "", 0) when none is. Stale entries met are dropped."""
        entries = self.entries
        for i in range(len(chain) - 1, -1, -1):
            e = entries.get(chain[i])
            if e is None:
                continue
            node, seq = e
            if seq <= self.watermark.get(node, 0):
                del entries[chain[i]]  # its node evicted it, as the engine showed
                continue
            if node in usable:
                entries.move_to_end(chain[i])
                return i + 1, node, seq
        return 0, "", 0

    def record(self, chain: list[int], node: str, start: int = 0) -> None:
        """`node` now holds the prompt of `chain`; blocks before `start` are known there
        already (refreshed through the longest one)."""
        entries = self.entries
        self._seq += 1
        seq = self._seq
        if 0 < start <= len(chain):
            entries[chain[start - 1]] = (node, seq)
            entries.move_to_end(chain[start - 1])
        for k in chain[start:]:
            entries[k] = (node, seq)
            entries.move_to_end(k)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def evicted(self, node: str, seq: int) -> None:
        """The engine on `node` no longer holds what was written at `seq`: nor anything
        written there before it."""
        if seq > self.watermark.get(node, 0):
            self.watermark[node] = seq

    def forget_node(self, node: str) -> None:
        self.evicted(node, self._seq)


# --- the decision and its counts -----------------------------------------------------------


@dataclass(slots=True)
class ModelStats:
    session: int = 0
    prefix: int = 0
    spread: int = 0
    moved: int = 0  # passed over by the load bound
    predicted: int = 0  # answers of requests placed on a predicted hit, usage seen
    confirmed: int = 0  # ... the engine reported the prefix as cached
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        ratio = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None
        hit = self.confirmed / self.predicted if self.predicted else None
        return {"placed": {SESSION: self.session, PREFIX: self.prefix, SPREAD: self.spread},
                "moved_by_load": self.moved, "prompt_tokens": self.prompt_tokens,
                "cached_prompt_tokens": self.cached_tokens,
                "cache_hit_ratio": None if ratio is None else round(ratio, 4),
                "predicted_hits": self.predicted, "confirmed_hits": self.confirmed,
                "prediction_accuracy": None if hit is None else round(hit, 4)}


class Affinity:
    """The hub's affinity: its settings, a prefix index per model, counts per model.
    `models` holds only models the router resolved (known ones): a bounded label set.

    1. A key per request (`key`), first found wins: the body's `prompt_cache_key`;
       the headers `x-session-id`, `x-claude-code-session-id`, `session_id`,
       `conversation_id`; Anthropic's `metadata.user_id` -- else the prefix-hash chain: the
       request rendered in chat-template order (tools, system, then the messages with role
       and content; for /api/generate and completions the prompt), cut into fixed blocks of
       `Router__AffinityBlockChars` bytes anchored at the start, each block's hash chained to
       the one before, at most `MAX_BLOCKS` blocks (none for a text under one block: spread
       by load, as there is too little to cache). A session value of any size is hashed at
       once; nothing of it, nor of the text, is kept, logged or used as a label.
    2. One node choice every hub agrees on without talking: rendezvous (highest random
       weight) hashing of the session key -- or of the first block -- over the candidates,
       with a load bound (`Router__AffinityLoadFactor`, HAProxy's `hash-balance-factor`
       rule from "Consistent Hashing with Bounded Loads", Mirrokni et al. 2016): a node may
       take the request while its in-flight + 1 stays within ceil(factor x (total + 1) / n)
       over the n candidates -- or within the mean + `BALANCE_SLACK`, whichever is more: at a
       handful of requests the factor alone moves sessions on every chance fluctuation (SGLang's
       cache-aware router has the same absolute threshold, 32 by default, for the same
       reason); one above it, or at its limit (no place left), is passed over for the next in
       rendezvous order. A node that joins or leaves moves only its share.
    3. A prefix index per model for requests without a session key: block hash -> the node
       that last served a prompt holding that block, LRU-bounded by
       `Router__AffinityIndexEntries`; the longest match wins, else rendezvous on the first
       block. Each entry carries the order it was written in; when the engine reports far
       fewer cached tokens than an entry predicted, that node evicted it, and -- engines
       evict least recently used first -- every entry of that node written before it is
       forgotten too (a per-node watermark, O(1)).

    Reasons, counted per model: `session` (a session key), `prefix` (a known prefix: a
    predicted cache hit), `spread` (nothing known: placed for load, today's routing -- also
    every request while affinity is off). `moved` counts requests the load bound sent off
    their first choice.
    """

    def __init__(self, enabled: bool = True, factor: float = 1.25, entries: int = 100_000,
                 block: int = 256) -> None:
        self.enabled, self.factor, self.entries, self.block = enabled, factor, entries, block
        self.index: dict[str, PrefixIndex] = {}
        self.models: dict[str, ModelStats] = {}

    def configure(self, enabled: bool, factor: float, entries: int, block: int) -> None:
        """New settings (SIGHUP); a new block size makes every indexed digest useless."""
        if block != self.block:
            self.index.clear()
        self.enabled, self.factor, self.entries, self.block = enabled, factor, entries, block
        for ix in self.index.values():
            ix.capacity = entries
            while len(ix.entries) > entries:
                ix.entries.popitem(last=False)

    def key(self, obj: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> Route:
        """The request's key: its session if it names one, else its prefix chain; while
        off an empty one, so the engines' cache figures are counted all the same (nothing
        is hashed)."""
        if not self.enabled:
            return Route()
        session = session_of(obj, headers)
        if session is not None:
            return Route(session=session)
        return Route(chain=chain_of(render(obj), self.block))

    def stats(self, model: str) -> ModelStats:
        s = self.models.get(model)
        if s is None:
            s = self.models[model] = ModelStats()
        return s

    def index_of(self, model: str) -> PrefixIndex:
        ix = self.index.get(model)
        if ix is None:
            ix = self.index[model] = PrefixIndex(self.entries)
        return ix

    def choose(self, model: str, route: Route, candidates: Sequence[Candidate]) -> str | None:
        """The node for `route` among `candidates` (None: none within the bound; the
        caller spreads). Fills `route.reason`, `node`, `matched`; counts the decision."""
        s = route.stats = self.stats(model)
        route.matched = route.entry_seq = 0
        if not candidates:
            route.reason, route.node = SPREAD, ""
            return None
        names = [c.name for c in candidates]
        matched = seq = 0
        node = ""
        if route.session is not None:
            order = rendezvous(route.session, names)
        elif route.chain:
            matched, node, seq = self.index_of(model).longest(route.chain, set(names))
            order = rendezvous(route.chain[0].to_bytes(8, "little"), names)
            if matched:
                order.remove(node)
                order.insert(0, node)
        else:
            order = []
        chosen, moved = first_within(order, candidates, self.factor)
        if moved:
            s.moved += 1
        if chosen is None:
            reason = SPREAD
        elif route.session is not None:
            reason = SESSION
        elif matched and chosen == node:
            reason = PREFIX
            route.matched, route.entry_seq = matched, seq
        else:
            reason = SPREAD
        route.reason, route.node = reason, chosen or ""
        setattr(s, reason, getattr(s, reason) + 1)
        return chosen

    def spread(self, model: str) -> None:
        """A request placed without affinity (off, or nothing to key on)."""
        self.stats(model).spread += 1

    def served(self, model: str, route: Route, node: str) -> None:
        """`node` answered `route`: the engine's word on its prompt cache (`prompt_tokens`,
        `cached_tokens`, from translate/usage.py's `Usage.cache`, when it gave one) is
        counted against the prediction, and the index learns that `node` holds this
        prompt now."""
        s = route.stats if route.stats is not None else self.stats(model)
        prompt, cached = route.prompt_tokens, route.cached_tokens
        ix = self.index.get(model) if route.chain else None
        if prompt is not None and cached is not None:
            s.prompt_tokens += prompt
            s.cached_tokens += cached
            if route.matched and node == route.node:
                s.predicted += 1
                expected = route.matched * self.block / BYTES_PER_TOKEN
                if cached >= CONFIRM_SHARE * min(expected, prompt):
                    s.confirmed += 1
                elif ix is not None:
                    ix.evicted(node, route.entry_seq)
        if route.chain and self.enabled:
            ix = ix if ix is not None else self.index_of(model)
            start = route.matched if node == route.node and route.matched else 0
            ix.record(route.chain, node, start)

    def status(self, model: str) -> dict[str, Any]:
        """How requests for `model` were placed, and what the engines said of their cache."""
        return (self.models.get(model) or ModelStats()).as_dict()
