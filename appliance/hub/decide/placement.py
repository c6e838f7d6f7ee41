"""What should run where: the model catalog, placement, parking and backoff (no I/O).

Owns `Models`, the control plane's memory and its decisions, as plain synchronous code: the
trio shell (control.py) hands it the nodes and the time, carries out the `Load` and
`Unload` actions it returns, and reports each load's outcome back. Nothing here sleeps,
dials or knows about trio. The rules (DESIGN 4): `Models`' docstring.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

from appliance.config import Config
from appliance.hub.decide import capable, fit, holds
from appliance.hub.decide.actions import Action, Load, Pending, Unload
from appliance.hub.decide.catalog import DISCOVERED_IDLE, Health, Spec, catalog, follows_demand
from appliance.hub.decide.demand import ReplicaDemand
from appliance.hub.decide.fit import Node
from appliance.wire import LoadRequest

log = logging.getLogger(__name__)

# First pause after a start failure; doubles per failure up to Models__RetryBackoffMaxSeconds.
BACKOFF_START = 1.0
# How long a load the node answered 200 counts as a replica before the node's own state
# shows it: a few heartbeats (DESIGN 2 default 2 s).
SETTLE_SECONDS = 10.0


class Models:
    """The rules (DESIGN 4):
    - A model is in the catalog (`Models__N__*`) or discovered on a node; discovered ones are
      on demand. Always-on models want `Replicas`; an on-demand model wants one replica from
      the moment it is asked for until `IdleUnloadSeconds` pass without a request, and then its
      idle replicas are unloaded -- where the engine can unload (capable.unloads: not on a
      fixed OpenAI-compatible upstream). A pass costs O(models x nodes): NodeState.model is
      an index, so 2,000 models on a node take milliseconds, not seconds.
    - Placement of one replica is fit.py's decision (memory, making room from idle on-demand
      replicas, the reason with its numbers). No node fits: the model is unplaceable; the
      warning is logged when the reason changes or every `Models__WarningIntervalSeconds`,
      never once per attempt.
    - Only nodes whose engine can serve the model count (capable.py). A start failure on one
      node is tried next on another capable node that has not failed it in this round, at
      once; only when every capable node failed does the round count as one failure:
    - A start failure (the node's answer, or none in time) counts; the next attempt waits a
      doubling backoff capped at `Models__RetryBackoffMaxSeconds`; `Models__ParkAfterFailures`
      in a row park the model: never placed again until its definition (Source, Profile or the
      profile's arguments) changes or it is retried. A success resets the count.
    - Asking for a model clears its previous placement result and decides afresh at once, so a
      model that fits once room is made is never refused on a stale answer.
    """
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.specs = catalog(cfg)
        self.health: dict[str, Health] = {n: Health() for n in self.specs}
        # Discovered models an operator deleted (/api/delete): forgotten once no node lists
        # them, unless one lists them again (a new pull).
        self.deleted: dict[str, bool] = {}  # name -> gone from every node since
        self.pending: list[Pending] = []
        self.events: list[tuple[str, dict[str, Any]]] = []  # audit events for the shell to write
        # An on-demand model's replica count following its predicted wait (demand.py);
        # admission reports to it.
        self.demand = ReplicaDemand()
        self.demand.follows = follows_demand(self.specs)

    # --- the catalog -------------------------------------------------------------------

    def spec(self, name: str) -> Spec:
        return self.specs.get(name) or Spec(name)

    def names(self, nodes: Iterable[Node]) -> list[str]:
        listed: set[str] = set()
        for h in nodes:
            if h.state is not None:
                listed.update(m.name for m in h.state.models)
        for name, gone in list(self.deleted.items()):
            if name in self.specs or (gone and name in listed):
                del self.deleted[name]  # configured, or pulled again: a model like any other
            elif name not in listed:
                self.deleted[name] = True
                self.health.pop(name, None)
        return sorted(set(self.specs) | set(self.health) | listed)

    def forget(self, name: str) -> None:
        """An operator deleted `name` from the engines: drop it once no node lists it."""
        self.deleted.setdefault(name, False)

    def _h(self, name: str) -> Health:
        h = self.health.get(name)
        if h is None:
            h = self.health[name] = Health()
        return h

    def reconfigure(self, cfg: Config) -> list[str]:
        """A reload: new and removed models applied; a changed definition unparks. Returns
        the models unparked."""
        new = catalog(cfg)
        unparked = []
        for name, spec in new.items():
            old = self.specs.get(name)
            h = self._h(name)
            if old is not None and old.definition() != spec.definition():
                was = h.parked
                h.parked, h.failures, h.next_attempt, h.unplaceable = False, 0, 0.0, ""
                h.tried.clear()
                if was:
                    unparked.append(name)
                    self.events.append(("model_unparked", {"model": name,
                                                           "why": "definition changed"}))
                    log.warning("model %s: definition changed; unparked", name)
        for name in set(self.specs) - set(new):
            self.health.pop(name, None)
        self.cfg, self.specs = cfg, new
        self.demand.follows = follows_demand(new)
        return unparked

    # --- what is where -----------------------------------------------------------------

    def desired(self, name: str, now: float) -> int:
        spec = self.spec(name)
        if spec.replicas:
            return spec.replicas
        if not self._wanted(name, now):
            return 0
        return max(1, min(spec.max_replicas, self.demand.target(name)))

    def _wanted(self, name: str, now: float) -> bool:
        h = self.health.get(name)
        if h is None or not h.asked:
            return False
        return now < holds.until(h.last_used, self._idle_limit(name), h.holds, now)

    def expires_in(self, name: str, now: float) -> float | None:
        """Seconds until an idle unload of `name` is due (None: never: always-on or kept)."""
        limit = self._idle_limit(name)
        if self.spec(name).replicas or limit == math.inf:
            return None
        h = self.health.get(name) or Health()
        return holds.until(h.last_used, limit, h.holds, now) - now

    def _idle_limit(self, name: str) -> float:
        """Seconds an on-demand model stays after its last use (inf: no idle unload)."""
        h = self.health.get(name)
        if h is not None and h.keep is not None:
            return h.keep
        idle = self.spec(name).idle_unload_seconds
        return math.inf if idle == 0 else idle

    def replicas(self, name: str, nodes: Iterable[Node]) -> tuple[list[str], list[str]]:
        """(ready node names, loading node names) counted for `name` now."""
        ready, loading = [], []
        for h in nodes:
            if h.ready(name):
                ready.append(h.name)
            elif (h.routable() and h.state is not None and (m := h.state.model(name)) is not None
                  and m.state == "loading"):
                loading.append(h.name)
        for p in self.pending:
            if p.model == name and p.node not in ready and p.node not in loading:
                loading.append(p.node)
        return ready, loading

    # --- placement ---------------------------------------------------------------------

    def place(self, name: str, nodes: Sequence[Node]) -> Load | str:
        """One replica of `name`: a Load (reserving its memory), or why it fits nowhere."""
        spec = self.spec(name)
        ready, loading = self.replicas(name, nodes)
        hl = self.health.get(name)
        # A node whose replica of it does not generate (unhealthy) takes no second one.
        sick = {h.name for h in nodes if h.routable() and h.unhealthy(name)}
        got = fit.choose(spec, nodes, set(ready) | set(loading) | sick, self.pending, self.spec,
                         lambda m: holds.recent(self.health.get(m)),
                         avoid=hl.tried if hl is not None else set())
        if isinstance(got, fit.NoFit):
            return got.why
        h, victims = got.node, got.victims
        for victim in victims:  # its want goes with it, or the two would evict each other forever
            self._h(victim).asked = False
        self.pending.append(Pending(name, h.name, fit.need_on(spec, h), victims=tuple(victims)))
        return Load(name, h.name, LoadRequest(source=spec.source, args=spec.args), victims)

    def _place_needed(self, name: str, nodes: Sequence[Node], now: float) -> list[Action]:
        """Place replicas up to what `name` should have now; record the decision."""
        h = self._h(name)
        if h.parked or now < h.next_attempt:
            return []
        acts: list[Action] = []
        while True:
            ready, loading = self.replicas(name, nodes)
            if len(ready) + len(loading) >= self.desired(name, now):
                h.unplaceable = ""
                return acts
            got = self.place(name, nodes)
            if isinstance(got, str):
                self._unplaceable(name, got, now)
                return acts
            h.unplaceable, h.warned_reason = "", ""
            acts.append(got)
            self.events.append(("model_placing", {"model": name, "node": got.node,
                                                  "unload": got.victims}))

    def _unplaceable(self, name: str, reason: str, now: float) -> None:
        h = self._h(name)
        h.unplaceable = reason
        interval = self.cfg.models.warning_interval_seconds
        if reason != h.warned_reason or now - h.warned_at >= interval:
            log.warning("model %s: no placement: %s", name, reason)
            self.events.append(("model_unplaceable", {"model": name, "reason": reason}))
            h.warned_reason, h.warned_at = reason, now

    # --- what the shell calls ----------------------------------------------------------

    def ask(self, name: str, nodes: Sequence[Node], now: float,
            held: bool = False) -> tuple[int, list[Action]]:
        """A request wants `name`: clear the previous result and decide afresh, now.
        `held`: its touch counted the use (a key's own hold: no shared clock, holds.py)."""
        self._settle(nodes, now)
        h = self._h(name)
        h.asked = True
        if not held:
            h.last_used = now
        h.asked_gen += 1
        h.unplaceable = ""
        acts = self._place_needed(name, nodes, now)
        h.decided_gen = h.asked_gen
        return h.asked_gen, acts

    def touch(self, name: str, now: float, keep: float | None = None,
              key: str | None = None) -> None:
        """A request used `name`; `keep`: its keep_alive in seconds (None: the default).
        `key` None: a managing request, whose keep_alive is everyone's (0 ends every hold);
        else a key that may not manage models, holding it for itself (holds.py)."""
        h = self.health.get(name)
        if h is None:
            h = self.health[name] = Health()
        if key is None:
            h.last_used, h.keep = now, keep
            if keep == 0:
                h.holds.clear()
            return
        spec = self.specs.get(name)
        idle = spec.idle_unload_seconds if spec is not None else DISCOVERED_IDLE
        own = holds.own_seconds(keep, math.inf if idle == 0 else idle)
        if own == math.inf:  # no idle unload configured: the shared clock's own rule
            h.last_used = now
        else:
            h.holds.hold(key, now, own)

    def requested(self, name: str, now: float) -> None:
        """A request for `name` was refused (parked, unplaceable): it is still wanted."""
        h = self._h(name)
        h.asked, h.last_used = True, now

    def next_due(self, now: float) -> float | None:
        """The earliest end of a backoff still ahead (the loop wakes for it)."""
        due = [h.next_attempt for h in self.health.values() if h.next_attempt > now
               and not h.parked]
        return min(due) if due else None

    def plan(self, nodes: Sequence[Node], now: float) -> list[Action]:
        """One pass of the control loop: settle loads, place what is missing, unload idle."""
        self._settle(nodes, now)
        acts: list[Action] = []
        for name in self.names(nodes):
            hl = self._h(name)
            if hl.last_used is None and hl.holds.last is None:
                hl.last_used = now  # first sight: idle time counts from here
            if self.desired(name, now) == 0:
                hl.asked, hl.unplaceable = False, ""
                self.demand.reset(name)
                acts += self._idle_unloads(name, nodes, now)
            else:
                acts += self._follow_demand(name, nodes, now)
                acts += self._place_needed(name, nodes, now)
        return acts

    def _follow_demand(self, name: str, nodes: Sequence[Node], now: float) -> list[Action]:
        """An on-demand model's count up one while its wait stays long (demand.py), or
        down one by unloading an idle replica beyond the first once it has fallen."""
        spec = self.spec(name)
        if spec.replicas or spec.max_replicas <= 1:
            return []
        ready, loading = self.replicas(name, nodes)
        if self.demand.grow(name, len(ready) + len(loading), spec.max_replicas, now):
            self.events.append(("replica_for_demand", {"model": name,
                                                       "replicas": self.demand.target(name)}))
            return []
        if loading or any(p.model == name for p in self.pending):
            return []
        by = {h.name: h for h in nodes}
        idle = [n for n in ready if not by[n].in_flight.get(name, 0)
                and not getattr(st.model(name) if (st := by[n].state) is not None else None,
                                "in_flight", 0)]
        victim = self.demand.surplus(name, idle, self._idle_limit(name), now)
        if victim is None:
            return []
        self.demand.shrunk(name)
        return [Unload(name, victim, "demand fell: a replica beyond the first, idle")]

    def _settle(self, nodes: Sequence[Node], now: float) -> None:
        """Loads the node answered stop counting once its state shows them (or after a while)."""
        by_name = {h.name: h for h in nodes}
        for p in list(self.pending):
            if p.settle_until is None:
                continue
            h = by_name.get(p.node)
            m = h.state.model(p.model) if h is not None and h.state is not None else None
            if now >= p.settle_until or (m is not None and m.state in ("ready", "failed")):
                self.pending.remove(p)

    def _idle_unloads(self, name: str, nodes: Sequence[Node], now: float) -> list[Action]:
        spec = self.spec(name)
        limit = self._idle_limit(name)
        if spec.replicas or limit == math.inf:
            return []
        if any(p.model == name or name in p.victims for p in self.pending):
            return []
        hl = self._h(name)
        if now < holds.until(hl.last_used, limit, hl.holds, now):
            return []
        out: list[Action] = []
        for h in nodes:
            if (h.ready(name) and capable.unloads(h) and h.state is not None
                    and (m := h.state.model(name)) is not None
                    and not m.in_flight and not h.in_flight.get(name, 0)):
                out.append(Unload(name, h.name, f"idle for {limit:g} s"))
        return out

    def load_done(self, model: str, node: str, error: str | None, now: float,
                  nodes: Sequence[Node] | None = None) -> None:
        """The node answered a load: None is success, else its words (a start failure).
        `nodes`: the fleet now; a failure is tried on another capable node of it first."""
        p = next((p for p in self.pending if p.model == model and p.node == node), None)
        h = self._h(model)
        if error is None:
            if p is not None:
                p.settle_until = now + SETTLE_SECONDS
            h.failures, h.last_error, h.next_attempt = 0, "", 0.0
            h.tried.clear()
            self.events.append(("model_loaded", {"model": model, "node": node}))
            return
        if p is not None:
            self.pending.remove(p)
        h.last_error = error
        h.tried.add(node)
        others = self._untried(model, nodes or [])
        if others:
            log.warning("model %s: start failed on %s: %s; trying another node (%s)", model,
                        node, error, ", ".join(others))
            self.events.append(("model_start_failed", {
                "model": model, "node": node, "error": error,
                "consecutive_start_failures": h.failures, "next_nodes": others}))
            return
        h.tried.clear()
        self._count_failure(model, node, error, now)

    def replica_failed(self, model: str, node: str, error: str, now: float) -> None:
        """A ready replica stopped generating (the node's probes): it counts toward parking
        like a failed start (the node restarts what it can; the next load resets it)."""
        h = self._h(model)
        h.last_error = error
        self._count_failure(model, node, error, now)

    def _count_failure(self, model: str, node: str, error: str, now: float) -> None:
        h = self._h(model)
        park = self.cfg.models.park_after_failures
        h.failures += 1
        fields = {"model": model, "node": node, "error": error,
                  "consecutive_start_failures": h.failures}
        if h.failures >= park:
            h.parked = True
            log.error("model %s: parked after %d failed starts in a row; last error: %s", model,
                      h.failures, error)
            self.events.append(("model_parked", fields))
            return
        delay = min(BACKOFF_START * 2 ** (h.failures - 1),
                    self.cfg.models.retry_backoff_max_seconds)
        h.next_attempt = now + delay
        log.warning("model %s: start %d/%d failed on %s: %s; next attempt in %g s",
                    model, h.failures, park, node, error, delay)
        self.events.append(("model_start_failed", {**fields, "retry_in": delay}))

    def _untried(self, model: str, nodes: Sequence[Node]) -> list[str]:
        """Capable nodes that are up and have not failed `model` in this round."""
        spec, tried = self.spec(model), self._h(model).tried
        return sorted(n.name for n in nodes
                      if n.routable() and n.name not in tried and capable.serves(spec, n)
                      and (spec.source or (n.state is not None
                                           and n.state.model(model) is not None)))

    def load_lost(self, model: str, node: str, reason: str, now: float) -> None:
        """The node could not be reached: not the model's fault, so nothing is counted."""
        self.pending = [p for p in self.pending if not (p.model == model and p.node == node)]
        h = self._h(model)
        h.next_attempt = max(h.next_attempt, now + BACKOFF_START)
        log.warning("model %s: load on %s not answered: %s", model, node, reason)

    def retry(self, name: str, now: float) -> bool:
        """`ctl retry`: unpark, forget the count and the backoff, and ask for it."""
        if name not in self.health and name not in self.specs:
            return False
        h = self._h(name)
        was = h.parked
        h.parked, h.failures, h.next_attempt, h.unplaceable = False, 0, 0.0, ""
        h.tried.clear()
        h.asked, h.last_used = True, now
        self.events.append(("model_retry", {"model": name, "was_parked": was}))
        return True

    # --- what the router and status read -----------------------------------------------

    def reason(self, name: str, now: float) -> str:
        h = self.health.get(name)
        if h is None:
            return ""
        if h.parked:
            return f"parked after {h.failures} failed starts in a row"
        if h.unplaceable:
            return h.unplaceable
        if h.failures and now < h.next_attempt:
            wait = h.next_attempt - now
            return f"start failed {h.failures} time(s); next attempt in {wait:.0f} s"
        return ""

    def status(self, name: str, nodes: Sequence[Node], now: float) -> dict[str, Any]:
        h = self.health.get(name) or Health()
        ready, loading = self.replicas(name, nodes)
        return {"name": name, "desired": self.desired(name, now), "ready": len(ready),
                "loading": len(loading),
                "parked": h.parked, "unplaceable": bool(h.unplaceable), "reason": self.reason(name,
                                                                                              now),
                "last_error": h.last_error, "consecutive_start_failures": h.failures,
                "nodes": sorted(ready)}
