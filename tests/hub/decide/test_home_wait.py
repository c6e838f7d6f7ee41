"""Cost-ordered placement inside admission (decide/cost.py, decide/home.py): a request
goes where its first token comes soonest, waits for its home node while that pays, moves
when the wait runs out -- and classes, the reserve and limits stay exact."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry

from appliance import config
from appliance.hub.decide.admission import Admission
from appliance.hub.decide.affinity import Route
from appliance.hub.observe import queue_metrics
from tests.harness.admission_fleet import MODEL, handle, registry

S = b"session-home-a!!"  # 16 bytes, like a digest
OTHER = b"the-other-one-a!"  # another session, at home on a
PROMPT_BYTES = 8000  # ~2000 tokens


def make(r, **env) -> Admission:
    env = {k: str(v) for k, v in env.items()}
    return Admission(config.load(env), r)


def teach(adm: Admission, home: str) -> None:
    """Session S answered on `home` with 2000 prompt tokens; every node serves in 0.5 s
    and prefills 1000 tokens a second (2 s cold for S)."""
    for n in ("a", "b"):
        adm.cost.rates.observe(n, MODEL, service_s=0.5, first_s=1.0, uncached=1000)
    route = Route(session=S, size=PROMPT_BYTES, prompt_tokens=2000, cached_tokens=0)
    adm.cost.learn(MODEL, route, home, service_s=None, first_s=None)
    other = Route(session=OTHER, size=PROMPT_BYTES, prompt_tokens=2000, cached_tokens=0)
    adm.cost.learn(MODEL, other, "a", service_s=None, first_s=None)  # `other` lives on a


async def hold(adm: Admission, done: trio.Event, log: list, name: str,
               route: Route | None = None, cls: str = "normal") -> None:
    async with adm.place(MODEL, cls, name, route=route) as p:
        await p.wait_slot()
        assert p.node is not None
        log.append((name, p.node.name, trio.current_time()))
        await done.wait()


def two_nodes(home: str = "a", **env):
    """Nodes a and b, an admission that learnt S's home (`teach`)."""
    a, b = handle("a"), handle("b")
    adm = make(registry(a, b), **env)
    teach(adm, home)
    return a, b, adm


async def s_behind_other(n: trio.Nursery, adm: Admission, log: list,
                         route: Route | None = None) -> tuple[trio.Event, trio.Event]:
    """`other` (at home on a) takes a place on a and keeps it until the first event is set;
    then S asks (with `route`) and keeps what it gets until the second is set."""
    busy, mine = trio.Event(), trio.Event()
    n.start_soon(hold, adm, busy, log, "other", Route(session=OTHER))
    await trio.testing.wait_all_tasks_blocked()
    n.start_soon(hold, adm, mine, log, "s", route or Route(session=S, size=PROMPT_BYTES))
    return busy, mine


async def test_a_request_waits_for_its_home_when_that_pays(autojump_clock):
    a, b, adm = two_nodes()
    log: list = []
    t0 = trio.current_time()
    route = Route(session=S, size=PROMPT_BYTES)
    async with trio.open_nursery() as n:
        busy, mine = await s_behind_other(n, adm, log, route)
        assert a.in_flight.get(MODEL) == 1  # `other` took a
        await trio.sleep(0.5)
        assert [x[0] for x in log] == ["other"]  # b is free, yet s waits for a
        assert a.in_flight[MODEL] == 2 and b.in_flight.get(MODEL, 0) == 0
        busy.set()
        await trio.sleep(0.1)
        mine.set()
    assert log[1] == ("s", "a", t0 + 0.5)
    predicted, waited, outcome = route.home_wait
    assert outcome == "home" and waited == 0.5 and predicted == 0.5
    assert adm.cost.queues.outcomes == {(MODEL, "home"): 1}
    assert a.in_flight_total == b.in_flight_total == 0


async def test_a_home_wait_past_its_bound_moves(autojump_clock):
    a, b, adm = two_nodes(Router__HomeWaitSeconds=1)
    log: list = []
    t0 = trio.current_time()
    route = Route(session=S, size=PROMPT_BYTES)
    async with trio.open_nursery() as n:
        busy, mine = await s_behind_other(n, adm, log, route)
        await trio.sleep(5)
        mine.set()
        busy.set()
    assert ("s", "b", t0 + 1) in log  # Router__HomeWaitSeconds=1, then the free node
    assert route.home_wait[1:] == (1.0, "moved")
    assert adm.cost.queues.outcomes == {(MODEL, "moved"): 1}
    assert a.in_flight_total == b.in_flight_total == 0


async def test_no_home_wait_with_zero_or_when_it_does_not_pay(autojump_clock):
    for env, service in (({"Router__HomeWaitSeconds": 0}, 0.5), ({}, 30.0)):
        a, b, adm = two_nodes(**env)
        adm.cost.rates.by[("a", MODEL)].service = service  # a slow line at home
        log: list = []
        async with trio.open_nursery() as n:
            busy, mine = await s_behind_other(n, adm, log)
            await trio.sleep(0.1)
            assert log[1][:2] == ("s", "b")  # at once, to the free node
            busy.set()
            mine.set()
        assert adm.cost.queues.outcomes == {}


async def test_with_a_place_at_home_it_goes_home_with_room_elsewhere_too(autojump_clock):
    a, b = handle("a", slots=2), handle("b", slots=2)
    adm = make(registry(a, b))
    teach(adm, "b")
    for _ in range(3):
        route = Route(session=S, size=PROMPT_BYTES)
        async with adm.place(MODEL, "normal", "c", route=route) as p:
            assert p.node.name == "b" and route.reason == "session" and p.home == 0
            assert route.predicted == (0.0, 0.0)  # no wait, all of it cached


async def on_node(adm: Admission, release: dict[str, trio.Event], log: list, name: str,
                  route: Route) -> None:
    """Hold a place until the event of the node it got is set."""
    async with adm.place(MODEL, "normal", name, route=route) as p:
        await p.wait_slot()
        assert p.node is not None
        log.append((name, p.node.name, trio.current_time()))
        await release[p.node.name].wait()


async def test_a_queued_request_granted_a_place_goes_home(autojump_clock):
    """Both nodes full (concurrency 1 each): s queues in admission, then `cold` behind
    it. b frees first; s is granted that place but a holds its prompt: s waits for a, and
    b's place goes to the next waiter (`cold`, nothing cached anywhere)."""
    a = handle("a", slots=1, max_concurrency=1)
    b = handle("b", slots=1, max_concurrency=1)
    adm = make(registry(a, b))
    teach(adm, "a")
    log: list = []
    first = {"a": trio.Event(), "b": trio.Event()}
    later = {"a": trio.Event(), "b": trio.Event()}
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        for name in ("x", "y"):
            n.start_soon(on_node, adm, first, log, name, Route(session=name.encode() * 16))
        await trio.testing.wait_all_tasks_blocked()
        assert {x[1] for x in log} == {"a", "b"}
        n.start_soon(on_node, adm, later, log, "s", Route(session=S, size=PROMPT_BYTES))
        await trio.sleep(0.1)
        n.start_soon(on_node, adm, later, log, "cold",
                     Route(session=b"c" * 16, size=PROMPT_BYTES))
        await trio.sleep(0.1)
        assert adm.core.statistics()["models"][MODEL]["waiting"] == 2
        first["b"].set()
        await trio.sleep(0.4)
        first["a"].set()
        await trio.sleep(0.1)
        later["a"].set()
        later["b"].set()
    placed = {name: (node, t) for name, node, t in log}
    assert placed["s"][0] == "a" and placed["s"][1] == pytest.approx(t0 + 0.6)
    assert placed["cold"] == ("b", t0 + 0.2)
    assert a.in_flight_total == b.in_flight_total == 0


async def test_reserve_stays_exact_with_a_home_wait(autojump_clock):
    """A normal request waiting for its home leaves b's place free; background still may
    not take the last free place (Priority__ReserveSlots=1)."""
    a, b = handle("a"), handle("b")
    adm = make(registry(a, b), Priority__Enabled="true")
    teach(adm, "a")
    log: list = []
    bg = trio.Event()
    async with trio.open_nursery() as n:
        busy, mine = await s_behind_other(n, adm, log)
        await trio.sleep(0.1)
        n.start_soon(hold, adm, bg, log, "batch", None, "background")
        await trio.sleep(0.2)
        assert [x[0] for x in log] == ["other"]
        assert adm.status_block()["background"]["waiting"] == 1
        busy.set()
        await trio.sleep(0.1)
        assert [x[:2] for x in log] == [("other", "a"), ("s", "a")]
        mine.set()
        await trio.sleep(0.1)
        assert log[-1][0] == "batch"  # two places free again: the reserve lets it go
        bg.set()


async def test_home_waits_counted_in_the_scrape(autojump_clock):
    a, b = handle("a"), handle("b")
    metrics = CollectorRegistry()
    adm = Admission(config.load({}), registry(a, b))
    queue_metrics.register(metrics, adm)
    teach(adm, "a")
    log: list = []
    async with trio.open_nursery() as n:
        busy, mine = await s_behind_other(n, adm, log)
        await trio.sleep(0.3)
        busy.set()
        await trio.sleep(0.1)
        mine.set()
    assert metrics.get_sample_value("appliance_home_waits_total",
                                    {"model": MODEL, "outcome": "home"}) == 1
