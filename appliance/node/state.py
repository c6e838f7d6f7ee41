"""What a node says about itself, and whether it takes one more request.

Theory of operation: `NodeStateKeeper` is the node's single source of truth and plain
synchronous code -- no sockets, no processes, no sleeping. It merges three things into
one `wire.NodeState` on demand: what the engine says (installs, models and their states),
what the node counts itself (requests in flight, total and per model; loads it started
and how they ended), and what the owner declared or the box measured (max concurrency,
slots, memory, paused, left). Every change bumps `version` and calls the listeners
(`add_listener`): the shell's `node/changes.py` wakes the watch stream from there, so it
publishes without polling.
In-flight counts are the exception: they ride on the next heartbeat (see `_counted`) --
unless several hubs watch (HA, `watchers` > 1): then they, and the routing keys of the
requests taken (`note_routed`, node/routed.py), are quiet changes (`quiet_version`) that the
watch stream sends at most every PUSH_SECONDS.

Each ready model's generation health comes from `health` (node/health.py) when set.

It makes one decision: `try_start(model)` admits a request (and counts it) or raises
`NoPlace` saying why not -- paused, left, draining, or at `Node__MaxConcurrency`. Slots
(`Node__ModelSlots`) are counted and published, never enforced here: the engine queues
past its slots, and the hub's admission is what keeps work inside them.

Over limits is the owner's budget being exceeded by the box as a whole: GPU memory used
by everything (as `nvidia-smi` measures it) above `Node__MemoryMb`, or work in flight
above a `Node__MaxConcurrency` that a reload lowered. The hub stops routing to a node
over its limits; the node itself keeps serving what it has.

Reading `nvidia-smi` is the trio shell's job (a thread); `parse_nvidia_smi` turns its
output into numbers and `set_gpu_memory` hands them in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from appliance.config import NodeConfig
from appliance.http.errors import ApiError
from appliance.node.health import ReplicaHealth
from appliance.node.routed import RoutedLog
from appliance.wire import EngineInstall, ModelState, NodeState

# The query the shell runs; one line per GPU, "total, used" in MiB.
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"]


def parse_nvidia_smi(text: str) -> tuple[int, int] | None:
    """`nvidia-smi` CSV -> (total MiB, used MiB) summed over GPUs; None if unreadable."""
    total = used = 0
    seen = False
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            return None
        try:
            t, u = int(float(parts[0])), int(float(parts[1]))
        except ValueError:
            return None
        total += t
        used += u
        seen = True
    return (total, used) if seen else None


class EngineView(Protocol):
    """The part of an Engine the keeper reads (so the core is tested without one)."""

    kind: str
    def installs(self) -> list[EngineInstall]: ...
    def models(self) -> list[ModelState]: ...
    def memory_used_mb(self) -> int: ...


class NoPlace(ApiError):
    """The node takes no new request now: 503 `no_capacity`, Retry-After 1, the message
    saying why (shutting down, left, paused, at Node__MaxConcurrency)."""

    def __init__(self, why: str) -> None:
        super().__init__(503, "no_capacity", why, retry_after=1)


class NodeStateKeeper:
    def __init__(self, name: str, node_cfg: NodeConfig, engine: EngineView) -> None:
        self.name = name
        self.engine = engine
        self.max_concurrency: int | None = node_cfg.max_concurrency
        self.slots: int | None = node_cfg.model_slots
        self.memory_mb: int | None = node_cfg.memory_mb
        self.paused = False
        self.hubs: list[str] = []  # hubs that gave orders lately (more than one: a fight)
        self.left = False
        self.draining = False
        self.in_flight: dict[str, int] = {}
        self.in_flight_total = 0
        # Loads this node started and has not seen end, and the last error of failed ones.
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}
        self.gpu: tuple[int, int] | None = None
        self.version = 0
        self.quiet_version = 0  # of `version`, the changes that were quiet only
        self.watchers = 0  # watch streams open now (hubs; several: HA)
        self.routed = RoutedLog()
        self.service: dict[str, float] = {}  # model -> mean seconds per answer (HA only)
        self.clock: Callable[[], float] = time.monotonic
        self._listeners: list[Callable[[], None]] = []
        # Each ready model's generation health (node/health.py); None: not watched.
        self.health: ReplicaHealth | None = None

    # --- change notification -----------------------------------------------------------

    def changed(self, quiet: bool = False) -> None:
        """Something changed (the engine calls this too): bump and wake the watchers.
        `quiet`: counts only (several hubs watching), sent at a bounded pace."""
        self.version += 1
        if quiet:
            self.quiet_version = self.version
        for fn in self._listeners:
            fn()

    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    # --- declared limits and the owner's switches ---------------------------------------

    def apply_limits(self, node_cfg: NodeConfig) -> list[str]:
        """Take new limits (a reload); returns what changed, as 'Node__X a -> b' lines."""
        out = []
        for var, attr, new in (
            ("Node__MaxConcurrency", "max_concurrency", node_cfg.max_concurrency),
            ("Node__ModelSlots", "slots", node_cfg.model_slots),
            ("Node__MemoryMb", "memory_mb", node_cfg.memory_mb),
        ):
            old = getattr(self, attr)
            if old != new:
                setattr(self, attr, new)
                out.append(f"{var} {old} -> {new}")
        if out:
            self.changed()
        return out

    def set_paused(self, paused: bool) -> None:
        if self.paused != paused:
            self.paused = paused
            self.changed()

    def set_left(self, left: bool) -> None:
        if self.left != left:
            self.left = left
            self.changed()

    def drain(self) -> None:
        """Shutting down: refuse new work, end the watch streams; running work goes on."""
        if not self.draining:
            self.draining = True
            self.changed()

    def set_gpu_memory(self, reading: tuple[int, int] | None) -> None:
        if reading != self.gpu:
            self.gpu = reading
            self.changed()

    # --- admission ---------------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why this node takes no new request now, or None."""
        if self.draining:
            return f"node {self.name} is shutting down"
        if self.left:
            return f"node {self.name} has left the fleet"
        if self.paused:
            return f"node {self.name} is paused by its owner"
        if self.max_concurrency is not None and self.in_flight_total >= self.max_concurrency:
            return (f"node {self.name} is at Node__MaxConcurrency {self.max_concurrency} "
                    f"({self.in_flight_total} in flight)")
        return None

    def try_start(self, model: str) -> None:
        """Admit one request for `model` and count it; raises NoPlace saying why not."""
        reason = self.refusal()
        if reason is not None:
            raise NoPlace(reason)
        over = bool(self.over_limits())
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        self.in_flight_total += 1
        self._counted(over)

    def finish(self, model: str) -> None:
        """One admitted request for `model` is over (completed, failed or abandoned)."""
        n = self.in_flight.get(model, 0)
        if n <= 1:
            self.in_flight.pop(model, None)
        else:
            self.in_flight[model] = n - 1
        over = bool(self.over_limits())
        self.in_flight_total = max(0, self.in_flight_total - 1)
        self._counted(over)

    def _counted(self, was_over: bool) -> None:
        """In-flight counts change with every request; they are published with the next
        heartbeat (the hub keeps its own counts), not as a state line per request. Only
        a change of what they decide (over the limits or not) is published at once."""
        if bool(self.over_limits()) != was_over:
            self.changed()
        elif self.watchers > 1:
            self.changed(quiet=True)

    def served(self, model: str, seconds: float) -> None:
        """A request for `model` was answered in `seconds` (several hubs watching): the
        mean the hubs start from (ModelState.service_ms), 1 in 5 the newest."""
        old = self.service.get(model)
        self.service[model] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def note_routed(self, model: str, key: str) -> None:
        """A request for `model` with a hub's routing key was taken: said to the other hubs
        (only while several watch; one hub knows where it sent its own)."""
        if self.watchers > 1:
            self.routed.note(model, key, self.clock())
            self.changed(quiet=True)

    # --- loads the node drives -----------------------------------------------------------

    def load_started(self, model: str) -> None:
        self._loading.add(model)
        self._failed.pop(model, None)
        self.changed()

    def load_done(self, model: str) -> None:
        self._loading.discard(model)
        self._failed.pop(model, None)
        self.changed()

    def load_failed(self, model: str, error: str) -> None:
        self._loading.discard(model)
        self._failed[model] = error
        self.changed()

    def unloaded(self, model: str) -> None:
        """An unload clears a failure: the model is plainly available again."""
        self._loading.discard(model)
        self._failed.pop(model, None)
        self.changed()

    # --- the published state -------------------------------------------------------------

    def over_limits(self) -> str:
        """Why the node is over the owner's limits, or "" when it is not."""
        if self.gpu is not None and self.memory_mb is not None and self.gpu[1] > self.memory_mb:
            return f"GPU memory used {self.gpu[1]} MiB is over Node__MemoryMb {self.memory_mb}"
        if self.max_concurrency is not None and self.in_flight_total > self.max_concurrency:
            return (f"{self.in_flight_total} requests in flight is over Node__MaxConcurrency "
                    f"{self.max_concurrency}")
        return ""

    def memory(self) -> tuple[int | None, int | None]:
        """(total, used) MiB: measured where nvidia-smi answers (total capped by the
        declared budget), else the declared budget and the engine's own account."""
        if self.gpu is not None:
            total, used = self.gpu
            if self.memory_mb is not None:
                total = min(total, self.memory_mb)
            return total, used
        return self.memory_mb, self.engine.memory_used_mb()

    def _models(self) -> list[ModelState]:
        out: list[ModelState] = []
        seen = set()
        for m in self.engine.models():
            m = ModelState(name=m.name, size_mb=m.size_mb, state=m.state, last_error=m.last_error,
                           meta=m.meta)
            seen.add(m.name)
            if m.state not in ("ready", "loading"):
                if m.name in self._loading:
                    m.state = "loading"
                elif m.name in self._failed:
                    m.state = "failed"
                    m.last_error = m.last_error or self._failed[m.name]
            m.in_flight = self.in_flight.get(m.name, 0)
            service = self.service.get(m.name) if self.service else None
            if service is not None:
                m.service_ms = max(1, round(service * 1000))
            if self.health is not None:
                m.health, m.health_error, m.probe_failures = self.health.of(m.name)
            out.append(m)
        # Loads of models the engine does not list (yet, or at all) still show.
        for name in sorted((self._loading | set(self._failed)) - seen):
            failed = name not in self._loading
            out.append(ModelState(name=name, state="failed" if failed else "loading",
                                  last_error=self._failed.get(name, "") if failed else "",
                                  in_flight=self.in_flight.get(name, 0)))
        return out

    def set_hubs(self, hubs: list[str]) -> None:
        """The hubs giving this node orders now (node/fence.py `Orders`)."""
        if hubs != self.hubs:
            self.hubs = hubs
            self.changed()

    def snapshot(self) -> NodeState:
        total, used = self.memory()
        reason = self.over_limits()
        return NodeState(
            name=self.name,
            engines=list(self.engine.installs()),
            engine=self.engine.kind,
            memory_total_mb=total,
            memory_used_mb=used,
            max_concurrency=self.max_concurrency,
            slots=self.slots,
            in_flight=self.in_flight_total,
            paused=self.paused,
            left=self.left,
            over_limits=bool(reason),
            over_limits_reason=reason,
            models=self._models(),
            hubs=list(self.hubs),
            routed=self.routed.recent(self.clock()) if self.routed.entries else [],
        )
