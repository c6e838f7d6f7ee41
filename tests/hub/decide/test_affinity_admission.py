"""Affinity inside admission (appliance/hub/decide/admission.py): it only orders the nodes
admission allows -- priority classes, the reserve, per-node limits stay exact."""

from __future__ import annotations

import trio
import trio.testing

from appliance.hub.decide.admission import Admission
from appliance.hub.decide.affinity import SESSION, SPREAD, Affinity, Route, rendezvous
from tests.harness.admission_fleet import MODEL, handle, registry
from tests.hub.decide.test_admission import make


def route_key(obj, headers, block):  # type: ignore[no-untyped-def]
    """A request's key as an affinity of `block`-byte blocks makes it."""
    return Affinity(block=block).key(obj, headers)

HOT = b"one-hot-session!"


async def go(adm: Admission, cls: str, client: str, log: list, hold: trio.Event | None = None,
             route: Route | None = None) -> None:
    async with adm.place(MODEL, cls, client, route=route) as place:
        node = place.node
        assert node is not None
        # per-node limits exact: never more in flight than the node's slots
        assert node.in_flight[MODEL] <= node.state.slots
        log.append((client, node.name, trio.current_time()))
        if hold is not None:
            await hold.wait()


async def test_priority_and_reserve_exact_with_affinity_on(autojump_clock):
    """The reserve test of test_admission.py, every request in one hot session: the same
    admissions at the same times; the session's home node, once full, is passed over."""
    a, b = handle("a"), handle("b")
    r = registry(a, b)
    adm, _ = make(r)
    assert adm.affinity.enabled
    home = rendezvous(HOT, ["a", "b"])[0]
    log: list = []
    long_done = trio.Event()
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(go, adm, "normal", "team", log, long_done, Route(session=HOT))
        await trio.sleep(1)
        n.start_soon(go, adm, "background", "batch", log, None, Route(session=HOT))
        await trio.sleep(1)
        assert [c for c, _, _ in log] == ["team"]
        assert adm.status_block()["background"]["waiting"] == 1  # the reserve holds it
        n.start_soon(go, adm, "essential", "ops", log, None, Route(session=HOT))
        await trio.sleep(1)
        await trio.sleep(10)
        long_done.set()
    assert [(c, t) for c, _, t in log] == [("team", t0), ("ops", t0 + 2), ("batch", t0 + 13)]
    other = "b" if home == "a" else "a"
    assert [n for _, n, _ in log] == [home, other, home]
    assert a.in_flight_total == b.in_flight_total == 0


async def test_a_session_stays_home_with_room_and_a_retry_goes_elsewhere(autojump_clock):
    nodes = [handle(f"gpu-{i}", slots=8) for i in range(4)]
    adm, metrics = make(registry(*nodes))
    keys = [f"s{i}".encode().ljust(16, b"-") for i in range(40)]
    for k in keys:
        route = Route(session=k)
        async with adm.place(MODEL, "normal", "c", route=route) as p:
            assert p.node.name == rendezvous(k, [h.name for h in nodes])[0]
            assert route.reason == SESSION
            first = p.node.name
            nxt = p.next(2)
            assert nxt is not None and nxt.name != first
    assert metrics.get_sample_value("appliance_routing_decisions_total",
                                    {"model": MODEL, "reason": "session"}) == 80


async def test_off_spreads_and_counts_spread(autojump_clock):
    nodes = [handle(f"gpu-{i}", slots=8) for i in range(3)]
    adm, metrics = make(registry(*nodes), Router__Affinity="off")
    assert not adm.affinity.enabled
    seen = set()
    for _ in range(6):
        async with adm.place(MODEL, "normal", "c", route=Route(session=HOT)) as p:
            seen.add(p.node.name)
    assert len(seen) == 3  # today's rotation among equal nodes
    assert metrics.get_sample_value("appliance_routing_decisions_total",
                                    {"model": MODEL, "reason": "spread"}) == 6


async def test_prefix_route_follows_the_node_that_served(autojump_clock):
    nodes = [handle(f"gpu-{i}", slots=8) for i in range(3)]
    adm, metrics = make(registry(*nodes))
    ctx = "a repository's worth of context " * 40
    convo = [{"role": "system", "content": ctx}, {"role": "user", "content": "q1"}]
    r1 = route_key({"messages": convo}, [], 256)
    async with adm.place(MODEL, "normal", "c", route=r1) as p:
        served = p.node.name
    assert r1.reason == SPREAD
    adm.affinity.served(MODEL, r1, served)
    convo += [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    r2 = route_key({"messages": convo}, [], 256)
    async with adm.place(MODEL, "normal", "c", route=r2) as p:
        assert p.node.name == served and r2.reason == "prefix"
    assert metrics.get_sample_value("appliance_routing_decisions_total",
                                    {"model": MODEL, "reason": "prefix"}) == 1
