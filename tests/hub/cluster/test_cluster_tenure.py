"""The leader's tenure and epoch against etcd's answers in virtual time (issue 22 item 7).

Each test here fails on one small realistic bug in hub/cluster/ that the rest of the suite
let through: the epoch read from the wrong revision, a record without a definition that
unparks, a tenure counted from a renewal's answer instead of its send, a leader that does
not step down when the key comes back under its name with another epoch, and a lapsed
tenure that still decides. `FakeEtcd` (tests/hub/cluster/test_cluster.py) answers with configurable
latency on trio's clock and logs every renewal, so the tenure a hub may honestly claim
is known to the test: until the latest renewal it has heard of, counted from its send.
"""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.hub.cluster import state
from appliance.hub.cluster.etcd import KV
from appliance.hub.decide.placement import Health
from appliance.hub.fleet.nodes import Registry
from tests.hub.cluster.test_cluster import LEASE, FakeEtcd, Hub, Store, fleet
from tests.hub.decide.test_control import add_node

LEADER = "appliance/leader"


def honest_deadline(etcd: FakeEtcd, now: float) -> float:
    """The latest end of tenure the hub may claim at `now`: of the renewals whose answer
    it has had by then, the latest send + TTL (etcd's expiry is never earlier)."""
    return max((sent + ttl for _, sent, answered, ttl in etcd.renewals if answered <= now),
               default=float("-inf"))


# --- the pure parts -----------------------------------------------------------------------


def test_the_epoch_is_the_leader_keys_create_revision_not_its_last_write():
    k = state.Keys("app")
    s = state.parse(k, 60, [KV("app/leader", "hub-a", 12, 57, 99)])
    assert (s.leader, s.epoch) == ("hub-a", 12)


def test_a_record_without_a_definition_keeps_the_model_parked():
    # Written by a leader that had no definition to record (an older version, a model
    # discovered on a node): nothing says the definition changed, so the failures stand.
    rec = state.HealthRecord(failures=5, parked=True, last_error="boom", definition=[])
    h = Health()
    assert state.adopt(h, rec, ("src", "p", "--a"), configured=True) is False
    assert (h.failures, h.parked, h.last_error) == (5, True, "boom")


# --- one hub, its tenure, and etcd's answers ---------------------------------------------


async def lone_leader(nursery) -> tuple[Store, Hub]:
    store, registry = Store(), Registry()
    add_node(registry, "n1", 8000, {"m": 500})
    hub = Hub("hub-a", store, registry, [{"Name": "m"}])
    await hub.start(nursery)
    await trio.sleep(1)
    assert hub.member.leading
    return store, hub


async def test_a_key_that_outlived_an_outage_is_led_again_under_its_create_revision(
        nursery, autojump_clock):
    store, a = await lone_leader(nursery)
    epoch, lease = a.member.epoch, store.kv[LEADER].lease
    assert epoch == store.kv[LEADER].create_revision
    a.etcd.down = True
    while a.member.tenure.epoch:  # its own clock ends the tenure
        await trio.sleep(0.05)
    # etcd kept the lease (as it does across its own restart), and the key was written
    # again meanwhile: its mod revision moved, its create revision -- the epoch -- did not.
    store.leases[lease] = (trio.current_time() + 100, LEASE)
    store.write(LEADER, "hub-a", lease)
    assert store.kv[LEADER].mod_revision > epoch == store.kv[LEADER].create_revision
    a.etcd.down = False
    await trio.sleep(2)
    assert a.member.leading and a.member.epoch == epoch and a.control.ops.epoch == epoch
    kinds = a.control.audit.kinds()
    assert kinds == ["leader_elected", "leader_stepped_down", "leader_elected"]  # no flapping


async def test_the_leader_key_back_under_this_name_with_a_new_epoch_ends_the_tenure(
        nursery, autojump_clock):
    store, a = await lone_leader(nursery)
    epoch = a.member.epoch
    # The key is gone and someone created it again under this hub's name (another process
    # with the same Hub__Name, or a restored backup): it is not this tenure's key.
    del store.kv[LEADER]
    store.leases[999] = (trio.current_time() + 100, 100)
    store.write(LEADER, "hub-a", 999)
    new = store.kv[LEADER].create_revision
    await trio.sleep(1)
    assert not a.member.leading and a.member.tenure.epoch == 0 and a.control.ops.epoch is None
    assert a.member.epoch == new > epoch
    assert ("leader_stepped_down", {"hub": "hub-a", "epoch": epoch,
                                    "why": f"the leader key names hub-a (epoch {new})"}
            ) in a.control.audit.events
    await trio.sleep(LEASE * 2)  # the key is not its own lease's: it does not lead again
    assert not a.member.leading


async def test_a_renewal_answered_late_counts_from_when_it_was_sent(nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    a.etcd.answer["keepalive"] = 1.0  # etcd renews at once; the hub hears of it 1 s later
    await trio.sleep(4)
    assert a.member.leading and len(a.etcd.renewals) >= 3
    a.etcd.down = True
    led = []
    while a.member.leading or not b.member.leading:
        now = trio.current_time()
        if a.member.leading:
            led.append(now)
            assert now < honest_deadline(a.etcd, now), "leading past the lease counted from its send"
            assert not b.member.leading
        await trio.sleep(0.01)
    end = honest_deadline(a.etcd, trio.current_time())
    assert led and end - 0.02 <= led[-1] < end  # it led up to that end, not beyond


# --- the property: a lapsed tenure decides nothing ----------------------------------------


class Decisions:
    """Every decision a hub makes, with its time: its control plane's plans and asks and
    retries, and its writes of the shared health records."""

    def __init__(self, hub: Hub) -> None:
        self.at: list[tuple[str, float]] = []
        control, core, etcd = hub.control, hub.control.core, hub.etcd
        ask, retry, plan, put = control.ask, control.retry, core.plan, etcd.put

        def record(kind: str) -> None:
            self.at.append((kind, trio.current_time()))

        def asked(model):
            record("ask")
            return ask(model)

        def retried(model):
            record("retry")
            return retry(model)

        def planned(nodes, now):
            record("plan")
            return plan(nodes, now)

        async def written(key, value, lease=0):
            if "/health/" in key:
                record("health")
            return await put(key, value, lease)

        control.ask, control.retry, core.plan, etcd.put = asked, retried, planned, written


async def tenure_run(latency: float, answers: dict[str, float], cut: float, asks: float) -> None:
    store, registry = Store(), Registry()
    add_node(registry, "n1", 8000, {"m": 500})
    hub = Hub("hub-a", store, registry, [{"Name": "m"}])
    hub.etcd.latency = latency
    hub.etcd.answer.update(answers)
    decisions = Decisions(hub)
    leading: list[float] = []

    async def follower() -> None:  # another hub's asks and retries, through etcd
        while True:
            await trio.sleep(asks)
            store.write("appliance/asks/m", "{}", 0)
            store.write("appliance/retry/m", "{}", 0)

    async def watch() -> None:
        while True:
            if hub.member.leading:
                leading.append(trio.current_time())
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        await hub.start(nursery)
        nursery.start_soon(follower)
        nursery.start_soon(watch)
        await trio.sleep(cut)
        hub.etcd.down = True  # etcd away: no renewal is heard of again
        await trio.sleep(LEASE + 3 * max([latency, *answers.values()]) + 2)
        assert not hub.member.leading
        nursery.cancel_scope.cancel()
    for kind, t in decisions.at + [("leading", t) for t in leading]:
        assert t < honest_deadline(hub.etcd, t), f"{kind} at {t:.3f}: the tenure had lapsed"
    # It led, unless winning (grant, put, create, read) took the whole lease or the time
    # before the cut.
    assert leading or 4 * latency + sum(answers.values()) >= min(cut, LEASE) - 0.1


LATENCY = st.floats(0.0, 0.8, allow_nan=False).map(lambda x: round(x, 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(latency=LATENCY,
       answers=st.dictionaries(st.sampled_from(["grant", "keepalive", "get_prefix", "put",
                                                "delete", "create"]), LATENCY, max_size=6),
       cut=st.floats(0.5, 6.0).map(lambda x: round(x, 2)),
       asks=st.floats(0.05, 1.5).map(lambda x: round(x, 2)))
def test_a_lapsed_tenure_decides_nothing(latency, answers, cut, asks):
    """Whatever etcd's latency and whenever it goes away: every plan, ask, retry and health
    write the leader makes, and every moment it says it leads, lies within the tenure its
    latest renewal allows, counted from that renewal's send."""
    trio.run(tenure_run, latency, answers, cut, asks,
             clock=trio.testing.MockClock(autojump_threshold=0))
