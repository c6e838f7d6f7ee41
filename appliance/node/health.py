"""Whether each loaded model really generates: the node's generation probes, decided.

Theory of operation: an engine's `/health` can stay green while generation is dead (a
kernel hang with the HTTP thread alive, a SIGSTOPped server). `ReplicaHealth` is plain
synchronous code -- no sockets, no sleeping; node/probe.py is its trio shell -- that keeps,
per ready model, when it last served something and whether it is healthy, and decides:

- `due(now)`: models that served nothing for `Node__ProbeSeconds` (no request in flight,
  no probe running) get a one-token generation now. 0 seconds: no probes at all.
- `probe_done(model, error)`: a probe that failed or took over `Node__ProbeTimeoutSeconds`
  (the shell's bound) marks the replica unhealthy; a good one restores it.
- `check(now)`: a streamed request that got no first byte from the engine within the same
  bound, while no other request of the model got a byte either, marks it unhealthy too (a
  non-streamed answer may rightly take longer; one queued behind others is not a hang; a
  prefill longer than the bound is: set the bound above the longest one).
Marking a replica unhealthy cuts the requests waiting on it for their first byte (their
`cut` callbacks: the proxy answers 503 `replica_unhealthy`, and the hub tries another
node) and calls `on_unhealthy(model)` (the shell restarts a process the node manages).
A model that leaves `ready` (unloaded, restarting) is forgotten: a fresh load is healthy.
It never counts against anyone's limits: probes are the node's own, not requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from appliance.wire import HEALTHY, UNHEALTHY


def _nothing(model: str) -> None:
    """No one restarts anything (a core built alone, in a test)."""


@dataclass
class Waiting:
    """One proxied request, from its send to the engine to its first byte back."""

    model: str
    since: float
    streamed: bool
    cut: Callable[[], None]
    answered: bool = False
    was_cut: bool = False  # cut because its replica was marked unhealthy


@dataclass
class _Replica:
    idle_since: float  # the end of the last thing it served (request, probe) or its load
    last_byte: float = float("-inf")  # the last body byte any request of it got
    probing: bool = False
    error: str = ""  # "": healthy
    waiting: list[Waiting] = field(default_factory=list)


class ReplicaHealth:
    def __init__(self, every: float, timeout: float,
                 on_change: Callable[[], None] = lambda: None,
                 on_unhealthy: Callable[[str], None] = _nothing) -> None:
        self.every, self.timeout = every, timeout
        self.on_change, self.on_unhealthy = on_change, on_unhealthy
        self.replicas: dict[str, _Replica] = {}
        # Probes that failed, per model, since the node started (never reset: a counter).
        self.failures: dict[str, int] = {}

    def configure(self, every: float, timeout: float) -> None:
        """New Node__ProbeSeconds / Node__ProbeTimeoutSeconds (a reload)."""
        self.every, self.timeout = every, timeout

    # --- what the model list says --------------------------------------------------------

    def loaded(self, ready: Iterable[str], now: float) -> None:
        """The models ready now; new ones start healthy and idle from `now`."""
        names = set(ready)
        gone = [m for m in self.replicas if m not in names]
        for m in gone:
            r = self.replicas.pop(m)
            for w in r.waiting:  # still counted by the proxy; no longer watched here
                w.answered = True
        for m in names - set(self.replicas):
            self.replicas[m] = _Replica(idle_since=now)
        if gone:
            self.on_change()

    def ready(self, model: str, now: float) -> None:
        """`model` serves here now (the proxy found its engine), known before the shell's next
        `loaded`: a request sent in between is watched too."""
        if model not in self.replicas:
            self.replicas[model] = _Replica(idle_since=now)

    # --- probes --------------------------------------------------------------------------

    def due(self, now: float) -> list[str]:
        """Models to probe now (each marked as probing until `probe_done`)."""
        if self.every <= 0:
            return []
        out = []
        for name, r in self.replicas.items():
            if r.probing or r.waiting:  # serving now: its requests say how it does
                continue
            if now - r.idle_since >= self.every:
                r.probing = True
                out.append(name)
        return out

    def probe_done(self, model: str, error: str | None, now: float) -> None:
        """A probe of `model` ended: None is a good one (healthy again), else why not."""
        r = self.replicas.get(model)
        if error is not None:
            self.failures[model] = self.failures.get(model, 0) + 1
        if r is None:  # unloaded meanwhile
            if error is not None:
                self.on_change()
            return
        r.probing = False
        r.idle_since = now
        if error is None:
            if r.error:
                r.error = ""
                self.on_change()
            return
        self._mark(model, r, error)

    # --- real requests -----------------------------------------------------------------

    def request(self, model: str, streamed: bool, now: float, cut: Callable[[], None]) -> Waiting:
        """A request is being sent to `model`'s engine; `cut()` ends its wait if the replica
        is marked unhealthy before its first byte."""
        w = Waiting(model, now, streamed, cut)
        r = self.replicas.get(model)
        if r is not None:
            r.waiting.append(w)
        else:
            w.answered = True  # not a ready model here: nothing to watch
        return w

    def answered(self, w: Waiting, now: float) -> None:
        """A body byte came back from the engine (called for each chunk of a stream)."""
        w.answered = True
        r = self.replicas.get(w.model)
        if r is not None:
            r.last_byte = now

    def ended(self, w: Waiting, now: float) -> None:
        w.answered = True
        r = self.replicas.get(w.model)
        if r is not None:
            if w in r.waiting:
                r.waiting.remove(w)
            r.idle_since = max(r.idle_since, now)

    def check(self, now: float) -> None:
        """Mark unhealthy every replica with a streamed request past the bound unanswered."""
        for name, r in list(self.replicas.items()):
            if r.error:
                continue
            if now - r.last_byte < self.timeout:  # it generates: a late one is queued
                continue
            late = [w for w in r.waiting if w.streamed and not w.answered
                    and now - w.since >= self.timeout]
            if late:
                self._mark(name, r, f"a streamed request got no first byte in {self.timeout:g} s "
                                    "(Node__ProbeTimeoutSeconds)")

    def next_check(self, now: float) -> float:
        """When something next falls due (a probe, a request's bound); `now` + timeout at most."""
        at = now + self.timeout
        for r in self.replicas.values():
            if self.every > 0 and not r.probing:
                at = min(at, r.idle_since + self.every)
            for w in r.waiting:
                if w.streamed and not w.answered:
                    at = min(at, w.since + self.timeout)
        return max(at, now)

    # --- what the node publishes ---------------------------------------------------------

    def of(self, model: str) -> tuple[str, str, int]:
        """(health, why, probe failures) for the model's published state."""
        r = self.replicas.get(model)
        error = r.error if r is not None else ""
        return (UNHEALTHY if error else HEALTHY), error, self.failures.get(model, 0)

    def unhealthy(self, model: str) -> str:
        """Why `model` is unhealthy here, or ""."""
        r = self.replicas.get(model)
        return r.error if r is not None else ""

    def _mark(self, model: str, r: _Replica, error: str) -> None:
        was = r.error
        r.error = error
        for w in list(r.waiting):
            if not w.answered:
                w.answered = w.was_cut = True
                w.cut()
        self.on_change()
        if not was:
            self.on_unhealthy(model)
