"""Where one more replica of a model fits: memory, making room, and the reason when nowhere.

Theory of operation: a pure function of the node handles and the loads in progress, used by
placement.py; it never changes anything. DESIGN 4: a replica goes to a routable node that
lists the model (or any routable node when the catalog gives a Source to load from) with
enough free memory -- the declared `MemoryMb`, else the node's size x 1.2 -- and loads in
progress reserve theirs. Only nodes whose engine can serve the model count (capable.py:
`Models__N__Engine`, a `.gguf` source is llama.cpp's), and not the nodes where a start
of it just failed (`avoid`: placement tries another capable node first). Among nodes
that fit, the most free wins. When none fits as it is, room may be made by unloading idle
on-demand replicas, least recently used first, choosing the node that needs the fewest
unloads; never an always-on replica, never one with work in
flight. When that fails too, the answer is `NoFit` with a reason that names the numbers an
operator needs ("needs 9800 MiB; the most free is 7900 MiB on gpu-a").

What it reads of a model's definition, a node and a load in progress is stated as the
protocols `Spec`, `Node` and `Reserved` (placement.py's Spec and Pending, hub/fleet/nodes.py's
NodeHandle), so the function is tested with plain stand-ins.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from appliance.hub.decide import capable
from appliance.wire import NodeState

# Headroom over a model's size when no MemoryMb is declared (DESIGN 4).
SIZE_FACTOR = 1.2


class Spec(Protocol):
    """A model's definition (placement.Spec)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def memory_mb(self) -> int | None: ...
    @property
    def replicas(self) -> int: ...


class Node(Protocol):
    """A node as the decision cores read it -- fit and placement here, admission's count
    (priority.py), the cost-ordered pick (cost.py): hub/fleet/nodes.NodeHandle, whose
    kind() capable.serves reads."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> NodeState | None: ...
    @property
    def in_flight(self) -> Mapping[str, int]: ...
    @property
    def in_flight_total(self) -> int: ...
    @property
    def others_total(self) -> int: ...  # other hubs' requests there (HA)
    def routable(self) -> bool: ...
    def status(self) -> str: ...
    def memory_free_mb(self) -> int | None: ...
    def kind(self) -> str: ...
    def ready(self, model: str) -> bool: ...
    def unhealthy(self, model: str) -> str: ...
    def places_left(self, model: str) -> int | None: ...
    def has_concurrency(self) -> bool: ...


class Reserved(Protocol):
    """A load in progress, holding its memory (actions.Pending)."""

    @property
    def model(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def need(self) -> int: ...
    @property
    def victims(self) -> tuple[str, ...]: ...


N = TypeVar("N", bound=Node)


@dataclass(frozen=True)
class Fit(Generic[N]):
    """One more replica goes on `node`, after unloading `victims` there (in this order)."""

    node: N
    victims: list[str]


@dataclass(frozen=True)
class NoFit:
    """No node can take one more replica; `why` names the numbers."""

    why: str


def need_on(spec: Spec, h: Node) -> int:
    """MiB the model of `spec` needs on node `h`: declared, else the node's size x 1.2."""
    if spec.memory_mb is not None:
        return int(spec.memory_mb)
    m = h.state.model(spec.name) if h.state is not None else None
    return math.ceil(m.size_mb * SIZE_FACTOR) if m is not None and m.size_mb else 0


def free_on(h: Node, pending: Sequence[Reserved]) -> int | None:
    """Free MiB on `h` less what loads in progress reserve; None: the node declares none."""
    free: int | None = h.memory_free_mb()
    if free is None or h.state is None:
        return free
    going: set[str] = getattr(h, "unloading", set())
    for name in going:  # being unloaded: its memory is as good as free
        m = h.state.model(name)
        if m is not None and m.state in ("ready", "loading"):
            free += m.size_mb
    for p in pending:
        if p.node == h.name:
            m = h.state.model(p.model)
            if m is None or m.state not in ("ready", "loading") or p.model in going:
                free -= p.need  # (the node counts the ones it shows itself)
    return free


def victims(h: Node, model: str, spec_of: Callable[[str], Spec],
            last_used_of: Callable[[str], float | None],
            pending: Sequence[Reserved]) -> list[tuple[str, int]]:
    """Idle on-demand replicas on `h` that may be unloaded for `model`, least recently used
    first, with the MiB each frees."""
    if h.state is None or not capable.unloads(h):
        return []
    busy = {m for p in pending if p.node == h.name for m in (p.model, *p.victims)}
    out = []
    for m in h.state.models:
        if (m.name == model or m.state != "ready" or m.name in busy or spec_of(m.name).replicas
                or m.in_flight or h.in_flight.get(m.name, 0)):
            continue
        last = last_used_of(m.name)
        out.append((m.name, m.size_mb or spec_of(m.name).memory_mb or 0, -math.inf if last is None
                    else last))
    out.sort(key=lambda v: v[2])
    return [(n, f) for n, f, _ in out]


def choose(spec: Spec, nodes: Sequence[N], holding: set[str], pending: Sequence[Reserved],
           spec_of: Callable[[str], Spec],
           last_used_of: Callable[[str], float | None],
           avoid: set[str] | frozenset[str] = frozenset()) -> Fit[N] | NoFit:
    """Where one more replica goes (and what to unload there first), or why nowhere.
    `avoid`: nodes where a start of it failed in this round."""
    name = spec.name
    up = [h for h in nodes if h.routable()]
    if not up:
        known = ", ".join(f"{h.name} {h.status()}" for h in nodes) or "none known"
        return NoFit(f"no node is up ({known})")
    able = [h for h in up if capable.serves(spec, h)]
    if not able:
        return NoFit(capable.why_none(spec, up))
    cands = [h for h in able if h.name not in holding and h.name not in avoid
             and h.state is not None and (spec.source or h.state.model(name) is not None)]
    if not cands and avoid and any(h.name in avoid for h in able):
        return NoFit(f"its start failed on {', '.join(sorted(avoid))} and no other node can "
                     "take it")
    if not cands:
        if holding:
            return NoFit(f"needs {spec.replicas or 1} replicas; every node that can hold it has "
                         f"one ({len(holding)})")
        return NoFit("no node that is up has it (and the catalog gives no Source to load it "
                     "from)")
    fits: list[tuple[float, str, N]] = []
    short: list[tuple[N, int, int]] = []
    for h in cands:
        need, free = need_on(spec, h), free_on(h, pending)
        if free is None or free >= need:
            fits.append((math.inf if free is None else free, h.name, h))
        else:
            short.append((h, need, free))
    if fits:
        return Fit(max(fits, key=lambda f: (f[0], f[1]))[2], [])
    plans: list[tuple[int, int, str, N, list[str]]] = []
    for h, need, free in short:
        got, chosen = free, []
        for victim, freed in victims(h, name, spec_of, last_used_of, pending):
            if got >= need:
                break
            got += freed
            chosen.append(victim)
        if got >= need:
            plans.append((len(chosen), -got, h.name, h, chosen))
    if plans:
        best = min(plans, key=lambda p: p[:3])
        return Fit(best[3], best[4])
    h, need, free = max(short, key=lambda s: (s[2], s[0].name))
    reclaim = sum(f for _, f in victims(h, name, spec_of, last_used_of, pending))
    extra = f" ({free + reclaim} MiB with its idle models unloaded)" if reclaim else ""
    return NoFit(f"needs {need} MiB; the most free is {free} MiB on {h.name}{extra}")
