"""Several hubs, one leader: the pure parts, and two members over an in-memory etcd in virtual time.

`FakeEtcd` keeps leases on trio's clock, so the election's timing (a partitioned leader
steps down when its lease ends; the other takes over after it, never before) is asserted
exactly under `autojump_clock`. The real etcd and real processes are tests/e2e/test_ha_e2e.py.
"""

from __future__ import annotations

import itertools

import pytest
import trio

from appliance.http.errors import ApiError
from appliance.hub.cluster import state
from appliance.hub.cluster.etcd import KV, Etcd, EtcdError, EtcdUnavailable, prefix_end, unb64
from appliance.hub.cluster.member import Member
from appliance.hub.decide import activation
from appliance.hub.decide.control import Control
from appliance.hub.decide.priority import count, ready_nodes
from appliance.hub.fleet.nodes import Registry
from appliance.hub.fleet.ops import StaleLeader
from tests.harness.etcd_proc import EtcdProc, free_port, needs_etcd
from tests.hub.decide.test_control import FakeAudit, FakeOps, add_node, error_of
from tests.hub.decide.test_placement import cfg

LEASE = 3
KEV = "unknown model architecture: 'kev'"


# --- the pure parts -----------------------------------------------------------------------


def test_tenure_ends_with_the_lease_counted_from_the_send():
    t = state.Tenure()
    assert not t.leading(0) and not t.lapsed(0)
    t.won(7, sent_at=10.0, lease_seconds=3)
    assert t.leading(12.9) and not t.leading(13.0) and t.lapsed(13.0)
    t.renewed(sent_at=12.0, ttl=3)
    assert t.leading(14.9) and t.lapsed(15.0)
    assert t.end() == 7 and not t.leading(11) and not t.lapsed(100)


def test_parse_reads_every_kind_and_skips_garbage():
    k = state.Keys("app")
    rec = state.HealthRecord(failures=5, parked=True, last_error=KEV, definition=["", "", ""],
                             decided=40)
    kvs = [KV("app/leader", "hub-a", 12, 12, 99), KV("app/hubs/hub-b", "{}", 3, 3, 1),
           KV("app/hubs/hub-a", "{}", 2, 2, 1),
           KV("app/health/kev", state.encode(rec), 20, 41, 0), KV("app/health/bad", "not json", 5,
                                                                  5, 0),
           KV("app/asks/m", "{}", 30, 44, 0), KV("app/retry/kev", "{}", 45, 45, 0),
           KV("app/cordons/n1", "hub-a", 9, 9, 0), KV("app/nodes/n2", "http://n2:9090", 8, 8, 0)]
    s = state.parse(k, 50, kvs)
    assert (s.leader, s.epoch, s.hubs, s.revision) == ("hub-a", 12, ["hub-a", "hub-b"], 50)
    assert s.health == {"kev": rec} and s.asks == {"m": 44} and s.retries == {"kev": 45}
    assert s.cordons == {"n1"} and s.nodes == {"n2": "http://n2:9090"}


def test_adopt_takes_failures_unless_the_definition_changed():
    from appliance.hub.decide.placement import Health

    rec = state.HealthRecord(failures=5, parked=True, last_error=KEV, unplaceable="",
                             definition=["src", "p", "--a"])
    h = Health()
    assert state.adopt(h, rec, ("src", "p", "--a"), configured=True) is False
    assert (h.failures, h.parked, h.last_error) == (5, True, KEV)
    h2 = Health()
    assert state.adopt(h2, rec, ("src", "p", "--b"), configured=True) is True  # a reload changed it
    assert (h2.failures, h2.parked) == (0, False)


def test_prefix_end_covers_the_prefix():
    assert unb64(prefix_end("appliance/")) == "appliance0"


# --- an in-memory etcd on trio's clock ----------------------------------------------------


class Store:
    def __init__(self) -> None:
        self.rev = 1
        self.kv: dict[str, KV] = {}
        self.leases: dict[int, tuple[float, int]] = {}  # id -> (expiry, ttl)
        self.ids = itertools.count(100)

    def expire(self) -> None:
        now = trio.current_time()
        for lid, (exp, _) in list(self.leases.items()):
            if now >= exp:
                self.drop(lid)

    def drop(self, lid: int) -> None:
        self.leases.pop(lid, None)
        for key in [k for k, v in self.kv.items() if v.lease == lid]:
            del self.kv[key]
            self.rev += 1

    def write(self, key: str, value: str, lease: int) -> int:
        if lease and lease not in self.leases:
            raise EtcdError("etcdserver: requested lease not found")
        self.rev += 1
        old = self.kv.get(key)
        self.kv[key] = KV(key, value, old.create_revision if old else self.rev, self.rev, lease)
        return self.rev


class FakeEtcd:
    """One hub's view of the store; `down` makes every call fail as an unreachable etcd.

    Latency on trio's clock: a call reaches the store `latency` seconds after it is sent,
    and its answer comes back `answer[call]` seconds after the store acted on it (a
    keepalive the store renews at once but the hub hears of late). `renewals` logs each
    grant or keepalive that kept a lease: (lease, sent, answered, ttl) -- what the hub may
    honestly count its tenure from."""

    def __init__(self, store: Store) -> None:
        self.s = store
        self.down = False
        self.latency = 0.01
        self.answer: dict[str, float] = {}
        self.renewals: list[tuple[int, float, float, int]] = []

    async def _call(self) -> Store:
        await trio.sleep(self.latency)
        if self.down:
            raise EtcdUnavailable("no etcd endpoint answered")
        self.s.expire()
        return self.s

    async def _back(self, call: str) -> None:
        await trio.sleep(self.answer.get(call, 0.0))

    async def grant(self, ttl):
        sent = trio.current_time()
        s = await self._call()
        lid = next(s.ids)
        s.leases[lid] = (trio.current_time() + ttl, ttl)
        await self._back("grant")
        self.renewals.append((lid, sent, trio.current_time(), ttl))
        return lid, ttl

    async def keepalive(self, lid):
        sent = trio.current_time()
        s = await self._call()
        if lid not in s.leases:
            await self._back("keepalive")
            return 0
        ttl = s.leases[lid][1]
        s.leases[lid] = (trio.current_time() + ttl, ttl)
        await self._back("keepalive")
        self.renewals.append((lid, sent, trio.current_time(), ttl))
        return ttl

    async def revoke(self, lid):
        (await self._call()).drop(lid)

    async def put(self, key, value, lease=0):
        rev = (await self._call()).write(key, value, lease)
        await self._back("put")
        return rev

    async def delete(self, key):
        s = await self._call()
        if s.kv.pop(key, None) is not None:
            s.rev += 1
        await self._back("delete")
        return s.rev

    async def get_prefix(self, prefix):
        s = await self._call()
        got = s.rev, [v for k, v in sorted(s.kv.items()) if k.startswith(prefix)]
        await self._back("get_prefix")
        return got

    async def create(self, key, value, lease):
        s = await self._call()
        got = (False, s.rev, s.kv[key]) if key in s.kv else (True, s.write(key, value, lease), None)
        await self._back("create")
        return got


class Hub:
    """A control plane and its cluster member, sharing one registry (the same nodes) with the other."""

    def __init__(self, name: str, store: Store, registry: Registry, models: list[dict]) -> None:
        self.etcd = FakeEtcd(store)
        c = cfg(models, Hub__Name=name, Cluster__Etcd="http://etcd:2379",
                Cluster__LeaseSeconds=LEASE,
                Router__ActivationWaitSeconds=30)
        self.ops = FakeOps(registry)
        self.control = Control(c, registry, None, FakeAudit(), ops=self.ops)
        self.member = Member(c, self.etcd, self.control, registry, lambda n, u: None)

    async def start(self, nursery) -> None:
        await nursery.start(self.control.run)
        await nursery.start(self.member.run)


async def fleet(nursery, models, nodes=None):
    store, registry = Store(), Registry()
    for name, (total, ms) in (nodes or {"n1": (8000, {m["Name"]: 500 for m in models})}).items():
        add_node(registry, name, total, ms)
    a, b = Hub("hub-a", store, registry, models), Hub("hub-b", store, registry, models)
    await a.start(nursery)
    await trio.sleep(0.1)  # a campaigns first
    await b.start(nursery)
    await trio.sleep(1)
    return store, a, b


async def test_one_leader_then_partition_failover_without_overlap(nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    assert a.member.leading and not b.member.leading
    assert b.member.leader() == "hub-a" and a.member.epoch == b.member.epoch == store.kv[
        "appliance/leader"].create_revision
    assert b.member.status()["hubs"] == ["hub-a", "hub-b"]
    a.etcd.down = True
    cut = trio.current_time()
    overlap = []
    while not b.member.leading:
        overlap.append(a.member.leading and b.member.leading)
        await trio.sleep(0.05)
    took = trio.current_time() - cut
    assert not a.member.leading and not any(overlap)
    assert LEASE - 0.5 <= took <= LEASE + 1  # after a's lease, within a tick of its end
    assert b.member.epoch > a.member.tenure.epoch == 0 and b.member.changes == 1
    assert a.control.ops.epoch is None and b.control.ops.epoch == b.member.epoch
    assert ("leader_elected", {"hub": "hub-b", "epoch": b.member.epoch}) in b.control.audit.events
    assert [k for k, _ in a.control.audit.events] == ["leader_elected", "leader_stepped_down"]
    a.etcd.down = False  # a returns: it follows
    await trio.sleep(2)
    assert not a.member.leading and a.member.leader() == "hub-b"


async def test_a_resigning_leader_hands_over_within_a_tick_and_keeps_following(
        nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    assert a.member.leading
    epoch = a.member.epoch
    a.member.resign()  # a clean stop: the lease is given up, not left to run out
    resigned = trio.current_time()
    while not b.member.leading:
        assert not a.member.leading  # at no time two leaders
        await trio.sleep(0.05)
    assert trio.current_time() - resigned <= b.member.tick + 0.2  # not LEASE
    assert b.member.epoch > epoch and a.control.ops.epoch is None
    assert ("leader_stepped_down", {"hub": "hub-a", "epoch": epoch,
                                    "why": "this hub is stopping"}) in a.control.audit.events
    await trio.sleep(LEASE * 2)  # a stands no more, and follows b
    assert not a.member.leading and a.member.leader() == "hub-b"
    assert b.member.status()["hubs"] == ["hub-b"]


async def test_parked_survives_failover_and_is_not_tried_again(nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "kev"}])
    a.ops.fail["kev"] = b.ops.fail["kev"] = KEV
    a.ops.load_seconds = b.ops.load_seconds = 0.2
    err = await TestError.of(b.control.activate("kev"))  # asked on the follower
    assert err.code == "model_parked" and KEV in err.message
    assert len(a.ops.loads) == 5 and b.ops.loads == []
    await trio.sleep(1)
    assert b.control.core.health["kev"].parked  # mirrored
    a.etcd.down = True
    while not b.member.leading:
        await trio.sleep(0.1)
    assert (await error_of(b.control.make_servable("kev"))).code == "model_parked"
    await trio.sleep(600)
    assert b.ops.loads == [] and len(a.ops.loads) == 5
    # `ctl retry` written by a follower (a, back) reaches the leader b.
    a.etcd.down = False
    await trio.sleep(2)
    await a.member.request_retry("kev")
    while len(b.ops.loads) < 5:
        await trio.sleep(0.1)
    await trio.sleep(5)
    assert len(b.ops.loads) == 5 and b.control.core.health["kev"].parked


async def test_follower_activation_is_placed_by_the_leader_once(nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    async with trio.open_nursery() as n:
        n.start_soon(b.control.activate, "m")
        n.start_soon(a.control.activate, "m")
        n.start_soon(b.control.activate, "m")
    assert [(node, model) for node, model, _ in a.ops.loads] == [("n1", "m")] and b.ops.loads == []


async def test_etcd_down_no_leader_then_back(nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    a.etcd.down = b.etcd.down = True
    start = trio.current_time()
    while a.member.leading:
        await trio.sleep(0.05)
    assert trio.current_time() - start <= LEASE
    for h in (a, b):
        assert not h.member.has_leader()
        err = await TestError.of(h.control.activate("m"))
        assert err.code == "no_leader" and err.retry_after == LEASE
    assert a.ops.loads == []
    a.etcd.down = b.etcd.down = False
    await trio.sleep(LEASE + 1)
    assert [a.member.leading, b.member.leading].count(True) == 1
    await b.control.activate("m")
    assert len(a.ops.loads) + len(b.ops.loads) == 1


async def test_a_node_refusing_our_epoch_counts_nothing_shows_fenced_and_no_flapping(
        nursery, autojump_clock):
    # A token holder fed the node a forged epoch: the node refuses the leader etcd confirms.
    # The leader neither steps down (that flapped once a second) nor counts the refusal
    # against the model; the node shows as fenced until it takes the leader's epoch again.
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    epoch, changes = a.member.epoch, a.member.changes

    async def refuse(h, model, req, read_seconds):
        raise StaleLeader("epoch 3 is older than 999999999999: another hub leads now")

    real, a.ops.load = a.ops.load, refuse
    a.control.ask("m")
    await trio.sleep(0.1)
    assert a.control.core.health["m"].failures == 0
    assert any(h.fenced for h in a.control.registry.nodes.values())
    await trio.sleep(LEASE * 3)
    assert a.member.leading and a.member.epoch == epoch and a.member.changes == changes
    # The leader re-asserts its epoch to every node each tick; a node that keeps a forged
    # one says so (status, appliance_node_fenced), one that takes ours is clear again.
    a.ops.forged["n1"] = 999_999_999_999
    await trio.sleep(1)
    n1 = a.control.registry.nodes["n1"]
    assert n1.epoch == 999_999_999_999 and "older than" in n1.fenced
    assert a.ops.asserted.count("n1") >= 2 and b.ops.asserted == []  # followers assert nothing
    del a.ops.forged["n1"]
    a.ops.load = real
    await trio.sleep(1)
    assert n1.fenced == "" and n1.epoch == epoch


class TestError:
    @staticmethod
    async def of(coro) -> ApiError:
        with pytest.raises(ApiError) as info:
            await coro
        return info.value


async def test_activate_via_leader_waits_for_the_decision_then_the_replica(autojump_clock):
    class Leader:
        lease_seconds = 3.0

        def __init__(self):
            self.leader, self.up, self.dec, self.asked = True, True, 0, []

        def has_leader(self):
            return self.leader

        async def ask_leader(self, model):
            self.asked.append(model)
            return 41

        def decided(self, model):
            return self.dec

    class Source:
        def __init__(self):
            self.ready, self.err = False, None

        def has_ready(self, model):
            return self.ready

        def why_unservable(self, model):
            return self.err

    lead, src = Leader(), Source()
    src.err = ApiError(503, "model_unplaceable", "fits nowhere")  # stale: not yet decided
    start = trio.current_time()
    async with trio.open_nursery() as n:
        async def decide():
            await trio.sleep(1.9)
            lead.dec = 41  # the leader decided our ask: still unplaceable
        n.start_soon(decide)
        err = await TestError.of(activation.activate_via_leader(lead, src, "m", 30))
    assert err.code == "model_unplaceable" and trio.current_time() == start + 2
    src.err, lead.dec = None, 0
    start = trio.current_time()
    err = await TestError.of(activation.activate_via_leader(lead, src, "m", 30))
    assert err.code == "model_loading" and trio.current_time() == start + 30
    # A failover in progress (etcd answers, no leader yet): the ask waits for the next one.
    lead.leader = False
    start = trio.current_time()
    async with trio.open_nursery() as n:
        async def elected():
            await trio.sleep(3.9)
            lead.leader, lead.dec, src.ready = True, 41, True  # the new leader decided and placed it
        n.start_soon(elected)
        await activation.activate_via_leader(lead, src, "m", 30)
    assert trio.current_time() == start + 4
    src.ready, lead.leader, lead.dec = False, False, 0
    err = await TestError.of(activation.activate_via_leader(lead, src, "m", 30))
    assert err.code == "no_leader" and "none elected within 30 s" in err.message
    lead.up = False  # etcd unreachable: at once
    start = trio.current_time()
    err = await TestError.of(activation.activate_via_leader(lead, src, "m", 30))
    assert err.code == "no_leader" and err.retry_after == 3.0 and trio.current_time() == start


def test_ctl_status_shows_the_cluster_line():
    from appliance import ctl

    body = {"satisfied": True, "problems": [], "models": [], "nodes": [],
            "cluster": {"name": "hub-b", "leader": "hub-a", "epoch": 812, "leading": False,
                        "hubs": ["hub-a", "hub-b"], "etcd_up": True}}
    out = ctl.render("status", body)
    assert "cluster: leader hub-a (epoch 812); hubs hub-a, hub-b; this hub hub-b; etcd up" in out.splitlines()
    body["cluster"].update(leader=None, etcd_up=False)
    assert "cluster: NO LEADER; hubs hub-a, hub-b; this hub hub-b; etcd UNREACHABLE" in ctl.render(
        "status", body)
    del body["cluster"]
    assert "cluster" not in ctl.render("status", body)  # one hub alone: as before


async def test_cordons_and_announced_nodes_reach_every_hub(nursery, autojump_clock):
    store, registry = Store(), Registry()
    add_node(registry, "n1", 8000, {})
    add_node(registry, "n2", 8000, {})
    store.write("appliance/cordons/n1", "hub-a", 0)
    store.write("appliance/nodes/n3", "http://n3:9090", 0)
    hub = Hub("hub-b", store, registry, [{"Name": "m"}])
    added = []
    hub.member.add_node = lambda name, url: (added.append((name, url)), add_node(registry, name,
                                                                                 8000, {}))
    await hub.start(nursery)
    await trio.sleep(1)
    assert registry.nodes["n1"].cordoned and not registry.nodes["n2"].cordoned
    assert added == [("n3", "http://n3:9090")]
    registry.nodes["n2"].cordoned = True  # cordoned here while etcd did not take it: not undone
    await trio.sleep(1)
    assert registry.nodes["n2"].cordoned
    await hub.member.set_cordon("n1", False)  # uncordoned on some hub
    await hub.member.set_cordon("n3", True)
    await trio.sleep(1)
    assert not registry.nodes["n1"].cordoned and registry.nodes["n3"].cordoned
    del registry.nodes["n3"]  # forgotten on this hub: not brought back by the next reads...
    await trio.sleep(1)
    assert "n3" not in registry.nodes and len(added) == 1
    store.write("appliance/nodes/n3", "http://n3:9090",
                0)  # ...only by announcing again (to any hub)
    await trio.sleep(1)
    assert "n3" in registry.nodes and len(added) == 2


@pytest.mark.e2e
@needs_etcd
async def test_real_etcd_client_failover_between_endpoints_and_auth(tmp_path):
    """The gateway client against Debian's etcd: a dead first endpoint is skipped; with auth
    on, user and password get a token; a wrong password is an EtcdError, not a hang."""
    import httpx

    proc = EtcdProc(tmp_path / "etcd")
    proc.start()
    try:
        dead = f"http://127.0.0.1:{free_port()}"
        async with httpx.AsyncClient(timeout=5) as http:
            e = Etcd([dead, proc.url], http)
            lease, ttl = await e.grant(5)
            assert ttl == 5 and await e.keepalive(lease) == 5
            won, rev, _ = await e.create("t/leader", "a", lease)
            again, _, held = await e.create("t/leader", "b", lease)
            assert won and not again and (held.value, held.create_revision,
                                          held.lease) == ("a", rev, lease)
            await e.revoke(lease)
            assert await e.keepalive(lease) == 0 and (await e.get_prefix("t/"))[1] == []
            for path, body in (("/v3/auth/user/add", {"name": "root", "password": "pw"}),
                               ("/v3/auth/role/add", {"name": "root"}),
                               ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                               ("/v3/auth/enable", {})):
                assert (await http.post(proc.url + path, json=body)).status_code == 200
            with pytest.raises(EtcdError):
                await Etcd([proc.url], http).put("t/x", "1")  # no credentials
            authed = Etcd([proc.url], http, "root", "pw")
            await authed.put("t/x", "1")
            assert [(kv.key, kv.value) for kv in (await authed.get_prefix("t/"))[1]] == [("t/x",
                                                                                          "1")]
            with pytest.raises(EtcdError):
                await Etcd([proc.url], http, "root", "wrong").put("t/x", "2")
    finally:
        proc.close()


def test_other_hubs_work_on_a_node_counts_in_free_places():
    """Priority's reserve across hubs: what the node counts beyond our own requests is
    another hub's, and takes places here too (a heartbeat late); ours count at once."""
    from appliance.wire import EngineInstall, ModelState, NodeState

    def state(total, m):
        return NodeState(name="n1", engines=[EngineInstall("sim", "0.1")], max_concurrency=3,
                         slots=2,
                         in_flight=total, models=[ModelState("m", 100, "ready", in_flight=m)])

    def places(registry):  # as admission counts them
        return count(ready_nodes(registry.nodes.values(), "m"), "m").places

    for shared, used in ((False, 1), (True, 2)):
        registry = Registry()
        registry.shared = shared
        h, _ = registry.upsert("n1", "http://n1:9090", static=False)
        registry.apply_state(h, state(0, 0))
        registry.start(h, "m")  # ours, counted at once
        registry.apply_state(h, state(2, 2))  # the node: ours and one from another hub
        assert places(registry) == 2 - used  # slots 2, less ours (and theirs when shared)
    assert (h.in_flight, h.in_flight_total, h.others) == ({"m": 2}, 2, {"m": 1})
    registry.finish(h, "m")  # ours done; theirs still counted until the node says otherwise
    assert places(registry) == 1
    registry.apply_state(h, state(1, 1))
    assert h.in_flight == {"m": 1} and h.others == {"m": 1}
    registry.apply_state(h, state(0, 0))  # theirs done
    assert (h.in_flight, h.in_flight_total, h.others, places(registry)) == ({"m": 0}, 0, {}, 2)


@pytest.mark.e2e
@needs_etcd
async def test_real_etcd_over_tls_with_a_client_certificate(tmp_path):
    """Cluster__TlsCa/TlsCert/TlsKey: etcd verified by our CA and shown our certificate;
    without the certificate etcd refuses the handshake and the client says no endpoint answered."""
    from appliance.config import ClusterConfig
    from appliance.hub.cluster import etcd as etcd_mod
    from tests.harness.pki import make_ca, make_cert

    ca = make_ca(tmp_path)
    server, hub = make_cert(tmp_path, ca, "etcd"), make_cert(tmp_path, ca, "hub")
    proc = EtcdProc(tmp_path / "etcd", tls=(ca.pem, *server))
    proc.start()
    try:
        cfg = ClusterConfig(etcd=proc.url, lease_seconds=6, tls_ca=ca.pem, tls_cert=hub[0],
                            tls_key=hub[1])
        async with etcd_mod.open_client(cfg) as http:
            e = etcd_mod.make(cfg, http)
            await e.put("t/x", "over tls")
            assert [kv.value for kv in (await e.get_prefix("t/"))[1]] == ["over tls"]
        no_cert = ClusterConfig(etcd=proc.url, lease_seconds=6, tls_ca=ca.pem)
        async with etcd_mod.open_client(no_cert) as http:
            with pytest.raises(EtcdUnavailable):
                await etcd_mod.make(no_cert, http).put("t/y", "1")
    finally:
        proc.close()


async def test_forget_on_one_hub_drops_the_node_on_the_others(nursery, autojump_clock):
    store, registry = Store(), Registry()
    forgotten = []
    registry.forget = lambda h: (forgotten.append(h.name),
                                 registry.nodes.pop(h.name))  # #10's Registry.forget
    add_node(registry, "old", 8000, {})
    store.write("appliance/forgotten/old", "hub-a", 0)  # forgotten before this hub started: stays
    hub = Hub("hub-b", store, registry, [{"Name": "m"}])
    await hub.start(nursery)
    await trio.sleep(1)
    assert "old" in registry.nodes and forgotten == []
    add_node(registry, "n1", 8000, {})
    add_node(registry, "n2", 8000, {})
    store.write("appliance/nodes/n2", "http://n2:9090", 0)  # between two reads of hub-b:
    store.write("appliance/forgotten/n1", "hub-a", 0)  # `ctl forget n1` on hub-a
    store.write("appliance/forgotten/n2", "hub-a", 0)
    store.write("appliance/nodes/n2", "http://n2:9090", 0)  # n2 announced again since
    await trio.sleep(1)
    assert forgotten == ["n1"] and "n2" in registry.nodes
    await hub.member.forgot("n2")  # here: written for the others, nodes/n2 gone
    assert "appliance/nodes/n2" not in store.kv and "appliance/forgotten/n2" in store.kv


def test_config_hub_urls_etcd_endpoints_and_prefix_validated():
    from appliance import config

    c = config.load({"Hub__Url": "http://hub-a:8080, http://hub-b:8080",
                     "Cluster__Etcd": "http://e1:2379,https://e2:2379/"})
    assert c.hub_urls() == ["http://hub-a:8080", "http://hub-b:8080"]
    assert c.cluster.endpoints() == ["http://e1:2379", "https://e2:2379"]
    assert (c.cluster.prefix, c.cluster.lease_seconds) == ("appliance", 10)
    for env, names in (({"Hub__Url": "http://a:1,hub-b:8080"}, "Hub__Url='hub-b:8080'"),
                       ({"Cluster__Etcd": "e1:2379"}, "Cluster__Etcd='e1:2379'"),
                       ({"Cluster__Prefix": "a/b"}, "Cluster__Prefix='a/b'"),
                       ({"Cluster__LeaseSeconds": "1"}, "Cluster__LeaseSeconds")):
        with pytest.raises(config.ConfigError) as info:
            config.load(env)
        assert names in str(info.value)


async def test_announced_elsewhere_never_moves_a_static_node_nor_passes_max_nodes(nursery,
                                                                                  autojump_clock):
    store, registry = Store(), Registry()
    h, _ = registry.upsert("gpu-a", "http://gpu-a:9090", static=True)
    store.write("appliance/nodes/gpu-a", "http://evil:9090", 0)
    store.write("appliance/nodes/n2", "http://n2:9090", 0)
    store.write("appliance/nodes/n3", "http://n3:9090", 0)
    hub = Hub("hub-b", store, registry, [{"Name": "m"}])
    hub.member.max_nodes = 2
    added = []
    hub.member.add_node = lambda name, url: (added.append(name), registry.upsert(name, url,
                                                                                 static=False))
    await hub.start(nursery)
    await trio.sleep(1)
    assert registry.nodes["gpu-a"].url == "http://gpu-a:9090"
    assert added == ["n2"] and set(registry.nodes) == {"gpu-a", "n2"}


async def test_etcd_json_that_is_no_object_is_an_etcd_error():
    """A gateway (or a proxy in front of it) that answers JSON but no object: EtcdError,
    not a TypeError out of the member's loop."""
    import httpx

    client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda req: httpx.Response(200, content=b"5")))
    async with client:
        with pytest.raises(EtcdError, match="answered 200: 5"):
            await Etcd(["http://etcd:2379"], client).put("k", "v")
