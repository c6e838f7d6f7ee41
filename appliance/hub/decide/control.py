"""The control plane: what runs where, as a thin trio shell around placement.Models.

Theory of operation: `Control.run` is the control loop in the hub's nursery. Each pass
(every `Hub__ControlIntervalSeconds`, and at once when the fleet changes, a model is asked
for or a load ends -- a request's end only while a model waits for room) hands the node
handles and the time to the synchronous core, which answers with loads and unloads; the
shell carries each out as its own task and reports the node's answer back. All node calls
go through `NodeOps` (injectable: the unit tests use a fake, so they need no sockets), each
with its bound at the call site: a load may take minutes, so it is bounded generously from
`Engine__StartTimeoutSeconds` and the node's own answer (502/504 with the engine's words)
is what normally ends it.

Interface the router and status rely on:
- `Control(cfg, registry, node_client, audit)`, `await run(task_status=)` (its series:
  hub/observe/fleet_metrics.py's `ControlCollector`, registered by the hub)
- `known(model)`: in the catalog or discovered on a node.
- `await make_servable(model, keep)`: the one call a request makes: returns once a replica
  is ready, or raises ApiError (parked; unplaceable by a fresh attempt -- a stored
  unplaceable result is never trusted -- or still loading after the wait). It asks for a
  placement at most once and waits for that very decision (activation.py).
- `touch(model)`: a request used it (idle unload counts from the last one).
- `models_status()`: the `models` list of /api/status (DESIGN 9 keys exactly).
- `reload(cfg)` (SIGHUP), `retry(model) -> bool` (`appliance ctl retry`).

With several hubs (`Cluster__Etcd`, appliance/hub/cluster/) `cluster` is this hub's member:
only while it leads does the loop plan (loads, unloads, idle unloads, backoff, parking),
every load and unload carrying its epoch (`NodeOps.epoch`); a node's 409 `stale_leader`
counts nothing against the model and marks the node fenced (only etcd ends a tenure; the
node gives a forged epoch up within a lease: node/fence.py). A follower's activation asks
the leader through etcd (activation.activate_via_leader). Without it `cluster` is None
and this hub always leads.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import msgspec
import trio

from appliance.config import Config
from appliance.http.errors import ApiError
from appliance.hub.decide import activation
from appliance.hub.decide.placement import Action, Load, Models, Unload
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.observe.audit import AuditLog
from appliance.wire import EPOCH_HEADER, LEASE_HEADER, LoadRequest


class Cluster(activation.Leader, Protocol):
    """This hub's cluster member (hub/cluster/member.py) as the control loop, its
    activation and its metrics read it."""

    changes: int  # leader changes seen

    @property
    def leading(self) -> bool: ...


log = logging.getLogger("appliance.hub.decide.control")

# Connecting to a node on the LAN: a few seconds or it is not there.
CONNECT_SECONDS = 10.0
# An unload or a pause/resume is quick on any engine; a minute is already a sick node.
UNLOAD_SECONDS = 60.0
CONTROL_SECONDS = 10.0
# Bound of one load: the node gives up after its Engine__StartTimeoutSeconds and answers
# 504; we wait for that answer, plus a model download's worth of slack on top.
LOAD_SLACK_SECONDS = 120.0

_enc = msgspec.json.Encoder()


def _error_of(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict):
            err = err.get("message")
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return f"node answered {resp.status_code}: {resp.text[:300]}"


class NodeRefused(Exception):
    """The node answered a control call with an error; the message is its (or its
    engine's) own words, `status` the HTTP status."""

    def __init__(self, status: int, words: str) -> None:
        super().__init__(words)
        self.status = status


class StaleLeader(Exception):
    """A node refused a load/unload: it has seen a newer leader's epoch."""


class NodeOps:
    """The node's control API over the hub's shared node client (node token included).
    `epoch`: the leader's epoch sent with every load and unload (HA fencing); None alone;
    `lease`: its lease length, sent beside it (node/fence.py)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.epoch: int | None = None
        self.lease = 0.0

    def _headers(self, **extra: str) -> dict[str, str]:
        if self.epoch is not None:
            extra[EPOCH_HEADER] = str(self.epoch)
            if self.lease:
                extra[LEASE_HEADER] = f"{self.lease:g}"
        return extra

    async def assert_epoch(self, h: NodeHandle) -> None:
        """The leader's epoch re-asserted to `h` (each tick): records on `h` the epoch the
        node keeps and, when it refuses ours, why (`h.fenced`). Raises httpx.TransportError."""
        resp = await self.client.post(f"{h.url}/node/v1/epoch", headers=self._headers(**h.auth),
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=CONTROL_SECONDS))
        try:
            epoch = resp.json().get("epoch")
        except (ValueError, AttributeError):
            epoch = None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**63:
            h.epoch = epoch
        h.fenced = "" if resp.status_code == 200 else _error_of(resp)[:300]

    @staticmethod
    def _answer(resp: httpx.Response, stale: bool = True) -> None:
        if resp.status_code == 409 and stale:
            raise StaleLeader(_error_of(resp))
        if resp.status_code != 200:
            raise NodeRefused(resp.status_code, _error_of(resp))

    async def load(self, h: NodeHandle, model: str, req: LoadRequest,
                   read_seconds: float) -> None:
        """Returns once ready. Raises NodeRefused (the engine's own words), StaleLeader,
        httpx.TransportError."""
        resp = await self.client.post(
            f"{h.url}/node/v1/models/{urllib.parse.quote(model, safe='')}/load",
            content=_enc.encode(req),
            headers=self._headers(**{"content-type": "application/json"}, **h.auth),
            timeout=httpx.Timeout(CONNECT_SECONDS, read=read_seconds))
        self._answer(resp)

    async def unload(self, h: NodeHandle, model: str) -> None:
        """Raises as `load` does."""
        resp = await self.client.post(
            f"{h.url}/node/v1/models/{urllib.parse.quote(model, safe='')}/unload",
                                      headers=self._headers(**h.auth),
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=UNLOAD_SECONDS))
        self._answer(resp)

    async def control(self, h: NodeHandle, action: str) -> None:
        """`pause`/`resume`/`leave`/`join`. Raises NodeRefused, httpx.TransportError."""
        resp = await self.client.post(f"{h.url}/node/v1/{action}", headers=h.auth,
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=CONTROL_SECONDS))
        self._answer(resp, stale=False)


class Control:
    def __init__(self, cfg: Config, registry: Registry, node_client: httpx.AsyncClient,
                 audit: AuditLog | None, *, ops: NodeOps | None = None,
                 beat: Callable[[], None] = lambda: None) -> None:
        self.cfg = cfg
        self.registry = registry
        self.audit = audit
        self.ops = ops if ops is not None else NodeOps(node_client)
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
        (an idle victim); idle unloads count from the touch that follows."""
        if self.core.waiting_for_room():
            self._wake.set()

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
                self._unloading[(act.node, act.model)] = trio.Event()
                if (h := self.registry.nodes.get(act.node)) is not None:
                    h.unloading.add(act.model)  # from the decision on, no request goes there
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
                raise httpx.ConnectError(f"node {act.node} is gone")
            going = self._unloading.get((act.node, act.model))
            if going is not None:  # bounded: the unload's own bound
                with trio.move_on_after(CONNECT_SECONDS + UNLOAD_SECONDS):
                    await going.wait()
            for victim in act.victims:
                if h.in_flight.get(victim, 0):
                    raise httpx.ConnectError(
                        f"{victim} on {act.node} took work while room was being made")
                log.info("unloading idle %s from %s to make room for %s", victim, act.node,
                         act.model)
                if self.audit is not None:
                    self.audit.event("model_unload", model=victim, node=act.node,
                                     why=f"room for {act.model}")
                h.unloading.add(victim)
                try:
                    await self.ops.unload(h, victim)
                except NodeRefused as e:  # still there: routable as before; the load may fail
                    h.unloading.discard(victim)
                    log.warning("unload of %s on %s refused: %s", victim, act.node, e)
                except BaseException:
                    h.unloading.discard(victim)  # still there: routable as before
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
                h.unloading.discard(act.model)  # loaded again: ready as the node says
        except httpx.TransportError as e:
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
                h.unloading.add(act.model)  # no new request goes there meanwhile
                await self.ops.unload(h, act.model)
                done = True
        except NodeRefused as e:
            log.warning("unload of %s on %s refused: %s", act.model, act.node, e)
        except (httpx.TransportError, StaleLeader) as e:
            log.warning("unload of %s on %s not done: %s", act.model, act.node, e)
        finally:
            if h is not None and not done:
                h.unloading.discard(act.model)  # still there: routable as before
            ev = self._unloading.pop((act.node, act.model), None)
            if ev is not None:
                ev.set()

    # --- what the router calls ---------------------------------------------------------

    def known(self, model: str) -> bool:
        return model in self.core.specs or model in self.registry.known_models()

    def ask(self, model: str) -> int:
        gen, actions = self.core.ask(model, self._nodes(), self.now())
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

    def why_unservable(self, model: str) -> ApiError | None:
        if self.has_ready(model):
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

    async def make_servable(self, model: str, keep: float | None = None) -> None:
        """Return once `model` has a ready replica; raise ApiError when it cannot have one
        (parked, unplaceable) or not within Router__ActivationWaitSeconds (model_loading).
        A placement is asked for at most once: an unplaceable answer is decided afresh
        (never refused on a stale one) and the activation waits for that very decision.
        `keep`: the request's keep_alive (a request that is served uses the model)."""
        asked = None
        err = self.why_unservable(model)
        if err is not None and err.code == "model_unplaceable":
            if not self.leading():
                err = None  # the activation asks the leader for a fresh decision
            else:
                asked = self.ask(model)
                err = self.why_unservable(model)
        if err is not None:
            self.core.requested(model, self.now())  # still wanted: status keeps counting it
            raise err
        # In use: the request's own keep_alive shows at once (a client's `ps` right after
        # its answer sees it); 0 applies only once the work is done.
        self.touch(model, None if keep == 0 else keep)
        if not self.registry.ready_nodes(model):
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

    def touch(self, model: str, keep: float | None = None) -> None:
        """A request used `model`; `keep`: its keep_alive in seconds (None: the catalog's)."""
        self.core.touch(model, self.now(), keep)
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
