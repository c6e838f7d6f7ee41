"""This hub as a member of a cluster of hubs: the election and the shared state (trio shell).

Theory of operation (issue: high availability on etcd). Two tasks in one nursery:

- `_campaign` holds a lease (`Cluster__LeaseSeconds`) and, while no one leads, runs the
  standard campaign transaction: create `{prefix}/leader` = this hub's name on the lease,
  only if absent. Won: the key's create revision is the epoch; the shared state is read
  once more, then this hub leads. Every tick it renews the lease; a renewal that finds
  the lease gone ends the tenure at once. It never claims longer than `Tenure` allows:
  when renewals stop answering (etcd down, this process frozen), leading ends at the
  lease's end by the clock -- `leading` is computed on every read, so a leader resumed
  from SIGSTOP stops deciding before its first new decision.
- `_follow` reads the whole prefix every tick (polled, not watched: a tick is far below
  the lease, and a poll has no stream to lose) into a `state.Snapshot`, and applies it:
  cordons and announced nodes on every hub; a follower mirrors model health into its
  control core (so status, metrics and "parked" refusals read the same on every hub);
  the leader answers followers' asks and retries through its own control core, and
  writes back every model's health that changed.

A clean stop (`resign`, at the start of the hub's drain) revokes the lease: the leader
key and this hub's key go with it, so another hub leads within a tick rather than after
the lease, while this one finishes its requests as a follower (`_follow` keeps running).

Etcd unreachable: nothing here raises; `up` goes false, the leader steps down when its
lease ends, and both loops keep trying at the tick, so service resumes by itself.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from appliance.bounds import CLEANUP_SECONDS
from appliance.client.upstream import UpstreamError
from appliance.config import Config
from appliance.hub.cluster import state
from appliance.hub.cluster.etcd import Etcd, EtcdError

if TYPE_CHECKING:
    from appliance.hub.decide.control import Control
    from appliance.hub.fleet.nodes import NodeHandle, Registry

log = logging.getLogger(__name__)

# The poll and campaign period: a quarter of the lease, at most half a second, so a dead
# leader's key is taken over within LeaseSeconds + 0.5 s and a follower sees a placement
# decision within half a second (noise against a model load).
MAX_TICK = 0.5


class Member:
    def __init__(self, cfg: Config, etcd: Etcd, control: Control, registry: Registry,
                 add_node: Callable[[str, str], None]) -> None:
        self.name = cfg.hub_name()
        self.keys = state.Keys(cfg.cluster.prefix)
        self.lease_seconds = float(cfg.cluster.lease_seconds)
        self.max_nodes = cfg.hub.max_nodes
        self.tick = min(self.lease_seconds / 4, MAX_TICK)
        self.etcd = etcd
        self.control = control
        self.registry = registry
        self.add_node = add_node
        self.tenure = state.Tenure()
        self.snapshot = state.Snapshot()
        self.up = False
        self.url = cfg.cluster.url.rstrip("/")  # as the other hubs reach this one (`advertise`)
        self._published: str | None = None  # the URL our hubs/NAME key holds
        self.peers = state.PeerUrls(grace=self.lease_seconds)
        self.changes = 0  # leader changes this hub has seen (appliance_leader_changes_total)
        self._seen_epoch = 0
        self._decided: dict[str, int] = {}
        self._retried: dict[str, int] = {}
        self._nodes: dict[str, int] = {}  # announced nodes applied: name -> revision
        self._forgotten: dict[str, int] = {}  # forgets applied: name -> revision
        self._read_once = False
        self._cordons: dict[str, bool] = {}  # etcd's word on each node's cordon, as last applied
        self._problem = ""
        self._campaigning = trio.CancelScope()  # `resign` cancels it
        self._advertised = trio.Event()  # ends the campaign's wait once (`advertise`)
        control.cluster = self
        registry.shared = True  # other hubs' work on our nodes counts in admission (nodes.py)

    # --- what the rest of the hub reads ------------------------------------------------

    def now(self) -> float:
        """The control loop's clock (trio's; its last reading outside a trio run)."""
        return float(self.control.now())

    @property
    def leading(self) -> bool:
        return self.tenure.leading(self.now())

    @property
    def epoch(self) -> int:
        return self.tenure.epoch if self.leading else self.snapshot.epoch

    def leader(self) -> str:
        """The leading hub's name, or "" when none is known to lead now."""
        if self.leading:
            return self.name
        return self.snapshot.leader if self.up else ""

    def has_leader(self) -> bool:
        return bool(self.leader())

    def decided(self, model: str) -> int:
        rec = self.snapshot.health.get(model)
        return rec.decided if rec is not None else 0

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "leader": self.leader() or None, "epoch": self.epoch,
                "leading": self.leading,
                "hubs": sorted(set(self.snapshot.hubs) | {self.name}), "etcd_up": self.up}

    # --- what the rest of the hub asks for ---------------------------------------------

    async def ask_leader(self, model: str) -> int:
        """A follower needs `model` placed: the ask's revision (the leader's record says
        `decided` >= it once the leader made its decision). Raises EtcdError."""
        return await self.etcd.put(self.keys.ask(model), json.dumps({"hub": self.name,
                                                                     "at": time.time()}))

    async def request_retry(self, model: str) -> None:
        await self.etcd.put(self.keys.retry(model), json.dumps({"hub": self.name,
                                                                "at": time.time()}))

    async def set_cordon(self, node: str, cordoned: bool) -> None:
        if cordoned:
            await self.etcd.put(self.keys.cordon(node), self.name)
        else:
            await self.etcd.delete(self.keys.cordon(node))

    async def announced(self, name: str, url: str, fresh: bool) -> None:
        """A node announced to this hub: every hub should dial it. Written when it is new to
        this hub (first seen, or back after being forgotten) or moved -- not every repeat."""
        if fresh or self.snapshot.nodes.get(name) != url:
            rev = await self.etcd.put(self.keys.node(name), url)
            self.snapshot.nodes[name] = url
            self._nodes[name] = rev  # already known here

    async def forgot(self, name: str) -> None:
        """`ctl forget` here: every hub drops the node (until it announces again)."""
        await self.etcd.delete(self.keys.node(name))
        self._forgotten[name] = await self.etcd.put(self.keys.forgotten(name), self.name)
        self.snapshot.nodes.pop(name, None)

    # --- the loops ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Started at once: a hub serves (ready models) whether or not etcd answers."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._campaign)
            nursery.start_soon(self._follow)
            task_status.started()

    def advertise(self, url: str) -> None:
        """This hub's URL (Hub__Listen as bound) unless Cluster__Url names one; published
        at once (the campaign's wait ends), so the others ask it a tick sooner."""
        if not self.url:
            self.url = url.rstrip("/")
            self._advertised.set()

    def hub_urls(self) -> dict[str, str]:
        """The running hubs' URLs by name, as etcd said within the last lease."""
        return self.peers.urls

    def resign(self) -> None:
        """A clean stop: decide nothing more, give the lease up now and stand no more;
        keep following."""
        if self.tenure.epoch:
            self._step_down("this hub is stopping")
        self._campaigning.cancel()

    async def _campaign(self) -> None:
        with self._campaigning:
            await self._stand()

    async def _stand(self) -> None:
        lease, lease_sent = 0, 0.0  # our lease, and when its last grant/renewal was sent
        try:
            while True:
                try:
                    if lease:
                        sent = self.now()
                        ttl = await self.etcd.keepalive(lease)
                        if ttl <= 0:  # expired while we could not renew it (etcd away, or we were)
                            lease = 0
                            if self.tenure.epoch:
                                self._step_down("its lease expired")
                        else:
                            lease_sent = sent
                            self.tenure.renewed(sent, ttl)
                    if not lease:
                        lease_sent = self.now()
                        lease, _ttl = await self.etcd.grant(int(self.lease_seconds))
                        self._published = None
                    url = self.url  # as written: `advertise` may change it while we wait
                    if self._published != url:
                        await self.etcd.put(self.keys.hub(self.name),
                                            json.dumps({"name": self.name, "url": url}), lease)
                        self._published = url
                    if not self.tenure.epoch:
                        won, rev, held = await self.etcd.create(self.keys.leader, self.name, lease)
                        if won:
                            await self._win(rev, lease_sent)
                        elif held is not None and held.lease == lease:
                            # Still ours: we stepped down while etcd was away, and the key
                            # outlived the outage (etcd keeps leases across a restart). No
                            # one else held it since, so its epoch is still the newest.
                            await self._win(held.create_revision, lease_sent)
                    self._ok()
                except EtcdError as e:
                    self._failed(e)
                self._check_tenure()
                if self._advertised.is_set():
                    await trio.sleep(self.tick)
                else:  # until the next tick, or this hub's URL is known: written at once
                    with trio.move_on_after(self.tick):
                        await self._advertised.wait()
        finally:
            if self.tenure.epoch:  # decide nothing more before the next leader can start
                self._step_down("this hub is stopping")
            if lease:  # a clean stop hands leadership over at once instead of after the lease
                with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                    try:
                        await self.etcd.revoke(lease)
                    except EtcdError:
                        pass

    async def _win(self, epoch: int, sent: float) -> None:
        """Lead from now until the lease renewed at `sent` would end."""
        await self._refresh()  # continue from the latest shared state, not from our mirror
        self.tenure.won(epoch, sent, self.lease_seconds)
        self._decided = {m: r.decided for m, r in self.snapshot.health.items()}
        self.control.ops.epoch = epoch
        self.control.ops.lease = self.lease_seconds
        log.warning("hub %s leads the fleet now (epoch %d)", self.name, epoch)
        self._audit("leader_elected", epoch=epoch)
        self._saw_epoch(epoch)
        self.control.leadership_changed()

    def _step_down(self, why: str) -> None:
        epoch = self.tenure.end()
        self.control.ops.epoch = None
        for h in self.registry.nodes.values():
            h.fenced = ""  # a follower sends no epoch: nothing to refuse
        log.warning("hub %s stepped down (epoch %d): %s", self.name, epoch, why)
        self._audit("leader_stepped_down", epoch=epoch, why=why)
        self.control.leadership_changed()

    def _audit(self, kind: str, **fields: Any) -> None:
        if self.control.audit is not None:
            self.control.audit.event(kind, hub=self.name, **fields)

    def _check_tenure(self) -> None:
        if self.tenure.lapsed(self.now()):
            self._step_down(f"no lease renewal for {self.lease_seconds:g} s")

    def _saw_epoch(self, epoch: int) -> None:
        if epoch and epoch != self._seen_epoch:
            if self._seen_epoch:
                self.changes += 1
            self._seen_epoch = epoch

    def _ok(self) -> None:
        if self._problem:
            log.warning("etcd answers again")
        self.up, self._problem = True, ""

    def _failed(self, e: Exception) -> None:
        if str(e) != self._problem:
            log.warning("etcd: %s (retrying every %g s; leading ends with the lease)", e, self.tick)
        self.up, self._problem = False, str(e)

    async def _follow(self) -> None:
        while True:
            try:
                await self._refresh()
                self._ok()
            except EtcdError as e:
                self._failed(e)
            self._check_tenure()
            await trio.sleep(self.tick)

    async def _refresh(self) -> None:
        rev, kvs = await self.etcd.get_prefix(self.keys.root)
        snap = state.parse(self.keys, rev, kvs)
        self.snapshot = snap
        self.peers.read(snap.hub_urls, self.now())
        self._saw_epoch(snap.epoch)
        if self.tenure.epoch and (snap.leader != self.name or snap.epoch != self.tenure.epoch):
            self._step_down(f"the leader key names {snap.leader or 'no one'} (epoch {snap.epoch})")
        self._apply_fleet(snap)
        if self.leading:
            await self._lead(snap)
            await self._assert_epoch()
        else:
            self._mirror(snap)

    async def _assert_epoch(self) -> None:
        """Every connected node hears this leader's epoch each tick: a node forgets an epoch
        no one asserts for a lease (node/fence.py), so a forged one ends there and a deposed
        leader stays refused while this one lives. Bounded by the tick; a node that does not
        answer in time is asked again at the next one."""
        ops = self.control.ops

        async def one(h: NodeHandle) -> None:
            try:
                await ops.assert_epoch(h)
            except UpstreamError:
                pass

        with trio.move_on_after(self.tick):
            async with trio.open_nursery() as nursery:
                for h in list(self.registry.nodes.values()):
                    if h.connected and not h.removed:
                        nursery.start_soon(one, h)

    def _apply_fleet(self, snap: state.Snapshot) -> None:
        for name, url in snap.nodes.items():
            # Once per announcement written (its revision), not on every read: a node this
            # hub has since forgotten comes back only by announcing again.
            if self._nodes.get(name) != snap.node_revs[name]:
                self._nodes[name] = snap.node_revs[name]
                h = self.registry.nodes.get(name)
                if h is not None and h.static:
                    # this hub's own configuration names it: another hub's word does not move it
                    continue
                if h is None and len(self.registry.nodes) >= self.max_nodes:
                    log.warning(
                        "node %s announced to another hub, not dialled here: Hub__MaxNodes=%d "
                        "reached",
                                name, self.max_nodes)
                    continue
                if h is None or h.url != url.rstrip("/"):
                    self.add_node(name, url)
        forget = getattr(self.registry, "forget", None)
        for name, rev in snap.forgotten.items():
            if self._forgotten.get(name) == rev:
                continue
            self._forgotten[name] = rev
            if not self._read_once:
                continue  # forgotten before this hub started: its own configuration stands
            h = self.registry.nodes.get(name)
            if forget is not None and h is not None and rev > snap.node_revs.get(name, 0):
                log.warning("node %s forgotten (by an operator on another hub)", name)
                forget(h)
        changed = False
        for name, h in list(self.registry.nodes.items()):
            # Applied when etcd's word for the node changes (or is first heard), so a local
            # cordon whose write failed is not undone by the next read.
            want = name in snap.cordons
            if self._cordons.get(name) != want:
                self._cordons[name] = want
                if h.cordoned != want:
                    h.cordoned, changed = want, True
        if changed:
            self.registry.changed()
        self._read_once = True

    def _mirror(self, snap: state.Snapshot) -> None:
        core = self.control.core
        for model, rec in snap.health.items():
            spec = core.spec(model)
            state.adopt(core._h(model), rec, spec.definition(), spec.configured)

    async def _lead(self, snap: state.Snapshot) -> None:
        """Every decision here checks `leading` first: an etcd answer awaited in between may
        come back after the tenure ended (the module's promise: a lapsed tenure decides
        nothing)."""
        control = self.control
        for model, rev in snap.retries.items():
            if not self.leading:
                return
            if rev > self._retried.get(model, 0):
                self._retried[model] = rev
                if control.known(model):
                    control.retry(model)
                await self.etcd.delete(self.keys.retry(model))
        for model, rev in snap.asks.items():
            if not self.leading:
                return
            if rev > max(self._decided.get(model, 0), self.decided(model)):
                if control.known(model):
                    control.ask(model)
                self._decided[model] = rev
        core = control.core
        for model, h in list(core.health.items()):
            if not self.leading:
                return
            rec = state.record_of(h, core.spec(model).definition(), self._decided.get(model, 0))
            raw = state.encode(rec)
            key = self.keys.health(model)
            if snap.raw.get(key) != raw:
                await self.etcd.put(key, raw)
                snap.raw[key] = raw
                snap.health[model] = rec
