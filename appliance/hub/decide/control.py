"""The control plane: what runs where, as a thin trio shell around placement.Models.

Owns the control loop (`Control.run`, in the hub's nursery): each pass -- every
`Hub__ControlIntervalSeconds`, and at once when the fleet changes, a model is asked for or
a load ends -- hands the nodes and the time to the synchronous core, carries out the loads
and unloads it answers, each as its own task through `NodeOps` (hub/fleet/ops.py,
injectable; at most MAX_IDLE_UNLOADS idle unloads at once), and reports the node's
answer back. A load is bounded from `Engine__StartTimeoutSeconds`; the node's own
502/504 normally ends it first.

What the router and status call: `known(model)` (translate.resolve asks it); `await
make_servable(model, keep)` (once a replica is ready, or ApiError: parked, unplaceable by a
fresh decision, still loading); `touch(model)`; `models_status()`; `reload(cfg)`; `retry(model)`.

With `Cluster__Etcd`, `cluster` is this hub's member: only while it leads does the loop
plan, every load and unload carrying its epoch; a node's 409 `stale_leader` marks the node
fenced. A follower's activation asks the leader through etcd (activation.py). It must not
decide placement (placement.py does) nor speak HTTP itself (ops.py does).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import trio

from appliance.client.upstream import Pool, UpstreamError
from appliance.config import Config
from appliance.http.errors import ApiError
from appliance.hub.decide import activation, capable
from appliance.hub.decide.actions import Action, Load, Unload
from appliance.hub.decide.placement import Models
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.fleet.ops import (
    CONNECT_SECONDS,
    UNLOAD_SECONDS,
    NodeGone,
    NodeOps,
    NodeRefused,
    StaleLeader,
)
from appliance.hub.observe.audit import AuditLog


class Cluster(activation.Leader, Protocol):
    """This hub's cluster member (hub/cluster/member.py) as the control loop, its
    activation and its metrics read it."""

    changes: int  # leader changes seen

    @property
    def leading(self) -> bool: ...


log = logging.getLogger(__name__)

# Idle unloads in flight at once: a pass that finds 2,000 idle replicas starts this many and
# the next passes (each unload's end wakes the loop) the rest -- a bounded burst of node
# calls, audit lines and state changes instead of all of them at once.
MAX_IDLE_UNLOADS = 8
# Bound of one load: the node gives up after its Engine__StartTimeoutSeconds and answers
# 504; we wait for that answer, plus a model download's worth of slack on top.
LOAD_SLACK_SECONDS = 120.0


class Control:
    def __init__(self, cfg: Config, registry: Registry, pool: Pool | None,
                 audit: AuditLog | None, *, ops: NodeOps | None = None,
                 beat: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.audit = audit
        self.ops = ops if ops is not None else NodeOps(pool or Pool(), cfg.hub_name())
        self.core = Models(cfg)
        self._nursery: trio.Nursery | None = None
        self._backlog: list[Action] = []
        self._wake = trio.Event()
        # Called once per turn of the loop: the hub feeds systemd's watchdog from here, so a
        # control loop that hangs gets the service restarted.
        self.beat = beat
        self._decided = trio.Event()
        # Idle unloads in flight, (node, model) -> set when done: a load of the same model
        # on the same node waits for it (keep_alive 0, then a request: unload, then load).
        self._unloading: dict[tuple[str, str], trio.Event] = {}
        self._deferred = False  # a pass left idle unloads out (MAX_IDLE_UNLOADS in flight)
        self._last_now = 0.0
        # appliance.hub.cluster.member.Member when Cluster__Etcd is set (it sets itself)
        self.cluster: Cluster | None = None
        registry.add_listener(self._wake_up, on_finish=self._finished)

    # --- the loop ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            backlog, self._backlog = self._backlog, []
            self._carry_out(backlog)
            task_status.started()
            while True:
                self.beat()
                now = self.now()
                if self.leading():
                    self._carry_out(self.core.plan(self._nodes(), now))
                wait = self.cfg.hub.control_interval_seconds
                due = self.core.next_due(now)
                if due is not None:
                    wait = min(wait, due - now)
                with trio.move_on_after(wait):
                    await self._wake.wait()
                self._wake = trio.Event()

    def now(self) -> float:
        """trio's clock; outside a trio run (a scrape from another thread) the last reading."""
        try:
            self._last_now = trio.current_time()
        except RuntimeError:
            pass
        return self._last_now

    def _wake_up(self) -> None:
        self._wake.set()

    def _finished(self) -> None:
        """A request finished: a plan can change only for a placement waiting for room
        (some model found no place at its last decision; a busy victim may be idle now);
        idle unloads count from the touch that follows."""
        for h in self.core.health.values():
            if h.unplaceable:
                self._wake.set()
                return

    def leading(self) -> bool:
        return self.cluster is None or self.cluster.leading

    def leadership_changed(self) -> None:
        """Won or lost: a winner plans at once; a loser's pending loads are the new leader's."""
        if not self.leading():
            self.core.pending.clear()
        self._decided.set()
        self._decided = trio.Event()
        self._wake_up()

    def _nodes(self) -> list[NodeHandle]:
        return [h for h in self.registry.nodes.values() if not h.removed]

    def _carry_out(self, actions: list[Action]) -> None:
        self._audit_events()
        if self._nursery is None:
            self._backlog += actions
            return
        for act in actions:
            if isinstance(act, Load):
                self._nursery.start_soon(self._load, act)
            elif isinstance(act, Unload) and (act.node, act.model) not in self._unloading:
                if len(self._unloading) >= MAX_IDLE_UNLOADS:
                    self._deferred = True  # the end of one in flight wakes the loop for it
                    continue
                self._unloading[(act.node, act.model)] = trio.Event()
                if (h := self.registry.nodes.get(act.node)) is not None:
                    # from the decision on, no request goes there
                    self.registry.unloading(h, act.model)
                self._nursery.start_soon(self._idle_unload, act)

    def _audit_events(self) -> None:
        events, self.core.events = self.core.events, []
        if self.audit is not None:
            for kind, fields in events:
                self.audit.event(kind, **fields)

    async def _load(self, act: Load) -> None:
        h = self.registry.nodes.get(act.node)
        bound = 2 * self.cfg.engine.start_timeout_seconds + LOAD_SLACK_SECONDS
        try:
            if h is None:
                raise NodeGone(f"node {act.node} is gone")
            going = self._unloading.get((act.node, act.model))
            if going is not None:  # bounded: the unload's own bound
                with trio.move_on_after(CONNECT_SECONDS + UNLOAD_SECONDS):
                    await going.wait()
            for victim in act.victims:
                if h.in_flight.get(victim, 0):
                    raise NodeGone(
                        f"{victim} on {act.node} took work while room was being made")
                log.info("unloading idle %s from %s to make room for %s", victim, act.node,
                         act.model)
                if self.audit is not None:
                    self.audit.event("model_unload", model=victim, node=act.node,
                                     why=f"room for {act.model}")
                self.registry.unloading(h, victim)
                try:
                    await self.ops.unload(h, victim)
                except NodeRefused as e:  # still there: routable as before; the load may fail
                    self.registry.unloading(h, victim, False)
                    log.warning("unload of %s on %s refused: %s", victim, act.node, e)
                except BaseException:
                    self.registry.unloading(h, victim, False)  # still there: routable as before
                    raise
            error = None
            with trio.move_on_after(bound) as scope:
                try:
                    await self.ops.load(h, act.model, act.request, bound)
                except NodeRefused as e:
                    error = str(e)
            if scope.cancelled_caught:
                error = f"node {act.node} did not answer the load within {bound:g} s"
            if error is None:
                # loaded again: ready as the node says
                self.registry.unloading(h, act.model, False)
        except (UpstreamError, NodeGone) as e:
            self.core.load_lost(act.model, act.node, f"{type(e).__name__}: {e}", self.now())
        except StaleLeader as e:
            self.core.load_lost(act.model, act.node, f"refused as a stale leader: {e}", self.now())
            log.warning("load of %s refused by %s: %s", act.model, act.node, e)
            if h is not None:
                # No step-down on a node's word: this hub's tenure is checked against etcd
                # every tick (a newer leader there ends it). A node that refuses a leader
                # etcd confirms keeps a forged or dead epoch: shown as fenced until it
                # takes ours again (node/fence.py: within one lease).
                h.fenced = str(e)[:300]
        else:
            self.core.load_done(act.model, act.node, error, self.now(), self._nodes())
        self._audit_events()
        self._wake_up()

    async def _idle_unload(self, act: Unload) -> None:
        h = self.registry.nodes.get(act.node)
        done = False
        try:
            if h is not None:
                log.info("unloading %s from %s: %s", act.model, act.node, act.why)
                if self.audit is not None:
                    self.audit.event("model_unload", model=act.model, node=act.node, why=act.why)
                self.registry.unloading(h, act.model)  # no new request goes there meanwhile
                await self.ops.unload(h, act.model)
                done = True
        except NodeRefused as e:
            log.warning("unload of %s on %s refused: %s", act.model, act.node, e)
        except (UpstreamError, StaleLeader) as e:
            log.warning("unload of %s on %s not done: %s", act.model, act.node, e)
        finally:
            if h is not None and not done:
                self.registry.unloading(h, act.model, False)  # still there: routable as before
            ev = self._unloading.pop((act.node, act.model), None)
            if ev is not None:
                ev.set()
            if self._deferred:  # a place for an idle unload a pass left out
                self._deferred = False
                self._wake_up()

    # --- what the router calls ---------------------------------------------------------

    def known(self, model: str) -> bool:
        """In the catalog or on a node: looked up in each node's model index
        (NodeState.model), not in a set of every name built per call -- a node with 2,000
        models costs a lookup no more than one with two."""
        if model in self.core.specs:
            return True
        for h in self.registry.nodes.values():
            if h.state is not None and h.state.model(model) is not None:
                return True
        return False

    def capabilities(self, model: str) -> set[str] | None:
        """What `model`'s engines say it can do (capable.py); None: nothing is known."""
        return capable.model_capabilities(self.core.spec(model),
                                          list(self.registry.nodes.values()), model)

    def ask(self, model: str, held: bool = False) -> int:
        """`held`: the asking request's touch counted its use (Models.ask)."""
        gen, actions = self.core.ask(model, self._nodes(), self.now(), held)
        self._carry_out(actions)
        self._decided.set()
        self._decided = trio.Event()
        self._wake_up()
        return gen

    async def wait_decided(self, model: str, generation: int) -> None:
        while self.core._h(model).decided_gen < generation:
            await self._decided.wait()

    def has_ready(self, model: str) -> bool:
        return bool(self.registry.ready_nodes(model))

    def why_unservable(self, model: str, ready: bool | None = None) -> ApiError | None:
        if self.has_ready(model) if ready is None else ready:
            return None
        h = self.core.health.get(model)
        if h is None:
            return None
        if h.parked:
            return ApiError(503, "model_parked",
                              f"model {model!r} is parked after {h.failures} failed starts in a "
                              "row; last error: "
                              f"{h.last_error}; fix it, then `appliance ctl retry {model}`")
        if h.unplaceable:
            return ApiError(503, "model_unplaceable",
                            f"model {model!r} fits on no node: {h.unplaceable}")
        return None

    async def make_servable(self, model: str, keep: float | None = None,
                            ready: bool | None = None, key: str | None = None) -> None:
        """Return once `model` has a ready replica; raise ApiError when it cannot have one
        (parked, unplaceable) or not within Router__ActivationWaitSeconds (model_loading).
        A placement is asked for at most once: an unplaceable answer is decided afresh
        (never refused on a stale one) and the activation waits for that very decision.
        `keep`: the request's keep_alive (a request that is served uses the model);
        `ready`: whether it has a ready replica, as the caller just found (None: look);
        `key`: a key that may not manage models, holding it for itself (holds.py)."""
        if ready is None:
            ready = self.has_ready(model)
        # In use: the request's own keep_alive shows at once (a client's `ps` right after
        # its answer sees it); 0 applies only once the work is done, and a key's own hold
        # is the whole idle time while it waits for the load.
        self.touch(model, None if keep == 0 or key is not None else keep, key)
        asked = None
        err = None if ready else self.why_unservable(model, ready)
        if err is not None and err.code == "model_unplaceable":
            if not self.leading():
                err = None  # the activation asks the leader for a fresh decision
            else:
                asked = self.ask(model, held=True)
                err = self.why_unservable(model)
        if err is not None:
            self.core.requested(model, self.now())  # still wanted: status keeps counting it
            raise err
        if not ready:
            if asked is None and self.leading():
                asked = self.ask(model, held=True)
            await self.activate(model, asked)

    async def activate(self, model: str, asked: int | None = None) -> None:
        """Wait for a ready replica of `model`: for the decision `asked` (a generation
        `ask` returned) or, without one, for a fresh one."""
        if self.leading():
            await activation.activate(self, model, self.cfg.router.activation_wait_seconds,
                                      asked)
        else:
            # wanted: this hub's status counts it as the leader's does
            self.core.requested(model, self.now())
            assert self.cluster is not None  # not leading: there is a cluster
            await activation.activate_via_leader(self.cluster, self, model,
                                                 self.cfg.router.activation_wait_seconds)

    def replica_failed(self, model: str, node: str, why: str) -> None:
        """A node says its ready replica stopped generating: counted toward parking like a
        failed start (by the leader only: one count per failure across hubs)."""
        if self.leading():
            self.core.replica_failed(model, node, why, self.now())
            self._wake_up()

    def touch(self, model: str, keep: float | None = None, key: str | None = None) -> None:
        """A request used `model`; `keep`: its keep_alive in seconds (None: the catalog's);
        `key`: a key that may not manage models: `keep` is its own hold (holds.py)."""
        self.core.touch(model, self.now(), keep, key)
        if keep is not None:
            self._wake_up()

    def forget(self, model: str) -> None:
        """`/api/delete` removed `model` from the engines: out of the catalog once gone from
        every node."""
        self.core.forget(model)
        self._wake_up()

    def expires_in(self, model: str) -> float | None:
        """Seconds until `model` is unloaded when idle; None: it stays (/api/ps's expires_at)."""
        return self.core.expires_in(model, self.now())

    # --- operators ---------------------------------------------------------------------

    def retry(self, model: str) -> bool:
        ok = self.core.retry(model, self.now())
        if ok:
            log.warning("model %s: retry asked by an operator", model)
            self._audit_events()
            self._wake_up()
        return ok

    def reload(self, cfg: Config) -> None:
        self.cfg = cfg
        self.core.reconfigure(cfg)
        self._audit_events()
        self._wake_up()

    def models_status(self) -> list[dict[str, Any]]:
        nodes, now = self._nodes(), self.now()
        return [self.core.status(n, nodes, now) for n in self.core.names(nodes)]

    def model_details(self) -> list[dict[str, Any]]:
        """models_status plus what the admin API and ctl show: definition and satisfaction."""
        out = []
        for st in self.models_status():
            spec = self.core.spec(st["name"])
            out.append({**st, "on_demand": spec.replicas == 0, "configured": spec.configured,
                        "source": spec.source,
                        "profile": spec.profile, "memory_mb": spec.memory_mb,
                        "satisfied": st["ready"] >= st["desired"] and not st["parked"]})
        return out
