"""The admission trio shell (appliance/hub/decide/admission.py) on a fake fleet, with virtual time."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest

from appliance import config
from appliance.http.errors import ApiError
from appliance.hub.decide.admission import Admission
from appliance.hub.decide.priority import effective_class
from appliance.hub.observe import queue_metrics
from tests.harness.admission_fleet import MODEL, handle, registry, set_state


def make(r, **env) -> tuple[Admission, CollectorRegistry]:
    env = {"Priority__Enabled": "true", **{k: str(v) for k, v in env.items()}}
    metrics = CollectorRegistry()
    adm = Admission(config.load(env), r)
    queue_metrics.register(metrics, adm)
    return adm, metrics


async def go(adm: Admission, r, model: str, cls: str, client: str, log: list,
             hold: trio.Event | None = None):
    """What the router does: one place (admitted, a node picked and counted in flight with
    no checkpoint between), given back when told."""
    async with adm.place(model, cls, client) as place:
        assert place.node is not None and place.tried == [place.node.name]
        assert place.node.in_flight[model] >= 1
        log.append((client, trio.current_time()))
        if hold is not None:
            await hold.wait()


async def test_reserve_held_and_released_by_a_finishing_request(autojump_clock):
    a, b = handle("a"), handle("b")
    r = registry(a, b)
    adm, _ = make(r)
    log: list = []
    long_done = trio.Event()
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(go, adm, r, MODEL, "normal", "team", log, long_done)
        await trio.sleep(1)
        n.start_soon(go, adm, r, MODEL, "background", "batch", log)
        await trio.sleep(1)
        assert [c for c, _ in log] == ["team"]
        assert adm.status_block()["background"]["waiting"] == 1
        n.start_soon(go, adm, r, MODEL, "essential", "ops", log)  # takes the reserved place
        await trio.sleep(1)
        assert [c for c, _ in log] == ["team", "ops"]
        await trio.sleep(10)
        long_done.set()
    assert log == [("team", t0), ("ops", t0 + 2), ("batch", t0 + 13)]
    s = adm.status_block()["background"]
    assert (s["waiting"], s["held"], s["released"], s["timed_out"], s["requests"]) == (0, 1, 1, 0,
                                                                                       1)


async def test_background_wait_ends_in_503_naming_the_client(autojump_clock):
    r = registry(handle("a"))
    adm, _ = make(r, Priority__BackgroundMaxWaitSeconds=45)
    t0 = trio.current_time()
    with pytest.raises(ApiError) as e:
        await adm.admit(MODEL, "background", "batch-nightly")
    assert trio.current_time() == t0 + 45
    assert (e.value.status, e.value.code) == (503, "priority_wait_timeout")
    assert "batch-nightly" in e.value.message
    assert adm.status_block()["background"]["timed_out"] == 1
    assert adm.core.queues == {}


async def test_node_lost_makes_background_wait_and_its_return_releases_it(autojump_clock):
    a, b = handle("a"), handle("b")
    r = registry(a, b)
    adm, _ = make(r)
    log: list = []
    r.mark_lost(b, "gone")
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(go, adm, r, MODEL, "background", "batch", log)
        await trio.sleep(5)
        await go(adm, r, MODEL, "essential", "ops", log)
        await go(adm, r, MODEL, "normal", "team", log)
        assert [c for c, _ in log] == ["ops", "team"]
        await trio.sleep(5)
        assert adm.status_block()["background"]["waiting"] == 1
        set_state(r, b)  # the node is back: its first state on a new watch stream
    assert log[-1] == ("batch", t0 + 10)


async def test_unbounded_node_holds_nothing(autojump_clock):
    r = registry(handle("a", slots=1), handle("free", slots=None))
    adm, _ = make(r, Priority__ReserveSlots=10)
    t0 = trio.current_time()
    await adm.admit(MODEL, "background", "batch")
    assert trio.current_time() == t0
    assert adm.status_block()["background"]["held"] == 0


async def test_class_order_in_the_capacity_wait(autojump_clock):
    a = handle("a", slots=None, max_concurrency=1)
    r = registry(a)
    adm, _ = make(r, Priority__ReserveSlots=0)
    log: list = []
    first_done = trio.Event()
    async with trio.open_nursery() as n:
        n.start_soon(go, adm, r, MODEL, "normal", "first", log, first_done)
        for client, cls in (("n1", "normal"), ("b1", "background"), ("e1", "essential"), ("n2",
                                                                                          "normal"),
                            ("e2", "essential")):
            await trio.sleep(1)
            n.start_soon(go, adm, r, MODEL, cls, client, log)
        await trio.sleep(1)
        assert adm.statistics()["models"][MODEL]["waiting"] == 5
        first_done.set()
    assert [c for c, _ in log] == ["first", "e1", "e2", "n1", "n2", "b1"]


def one_busy_place():
    """A node of one place, taken."""
    a = handle("a", slots=None, max_concurrency=1)
    r = registry(a)
    r.start(a, MODEL)
    return a, r


async def test_queue_timeout_with_retry_after(autojump_clock):
    _, r = one_busy_place()
    adm, metrics = make(r, Queue__MaxWaitSeconds=30)
    t0 = trio.current_time()
    with pytest.raises(ApiError) as e:
        await adm.admit(MODEL, "essential", "ops")
    assert trio.current_time() == t0 + 30
    assert (e.value.code, e.value.retry_after) == ("queue_timeout", 5.0)
    assert metrics.get_sample_value("appliance_queue_timeouts_total", {"model": MODEL}) == 1


async def test_queue_full_is_answered_at_once(autojump_clock):
    _, r = one_busy_place()
    adm, metrics = make(r, Queue__MaxDepth=1)
    async with trio.open_nursery() as n:
        n.start_soon(adm.admit, MODEL, "normal", "one")
        await trio.sleep(1)
        t0 = trio.current_time()
        with pytest.raises(ApiError) as e:
            await adm.admit(MODEL, "normal", "two")
        assert trio.current_time() == t0
        assert (e.value.code, e.value.retry_after) == ("queue_full", 5.0)
        assert metrics.get_sample_value("appliance_queue_rejected_total", {"model": MODEL}) == 1
        n.cancel_scope.cancel()


async def quitter_and_one_behind(n: trio.Nursery, adm: Admission, r, log: list,
                                 behind: str) -> trio.CancelScope:
    """An essential request waits for the busy place (cancel the scope returned: its client
    hangs up), then a normal one called `behind`."""
    gone = trio.CancelScope()

    async def hangs_up():
        with gone:
            await go(adm, r, MODEL, "essential", "quitter", log)

    n.start_soon(hangs_up)
    await trio.sleep(1)
    n.start_soon(go, adm, r, MODEL, "normal", behind, log)
    await trio.sleep(1)
    return gone


async def test_a_client_that_hangs_up_leaves_the_queue_at_once(autojump_clock):
    a, r = one_busy_place()
    adm, metrics = make(r)
    log: list = []
    async with trio.open_nursery() as n:
        gone = await quitter_and_one_behind(n, adm, r, log, "stays")
        assert metrics.get_sample_value("appliance_queue_waiting", {"model": MODEL}) == 2
        t = trio.current_time()
        gone.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == t
        assert metrics.get_sample_value("appliance_queue_waiting", {"model": MODEL}) == 1
        assert adm.status_block()["essential"]["waiting"] == 0
        r.finish(a, MODEL)
    assert [c for c, _ in log] == ["stays"]


async def test_a_granted_place_whose_client_hangs_up_goes_to_the_next(autojump_clock):
    a, r = one_busy_place()
    adm, _ = make(r)
    log: list = []
    async with trio.open_nursery() as n:
        gone = await quitter_and_one_behind(n, adm, r, log, "next")
        gone.cancel()  # cancelled first ...
        r.finish(a, MODEL)  # ... then granted, before its task ran
    assert [c for c, _ in log] == ["next"]
    assert adm.core.queues == {}


async def test_priority_off_nothing_waits_that_did_not_wait_before(autojump_clock):
    r = registry(handle("a"))
    metrics = CollectorRegistry()
    adm = Admission(config.load({"Priority__ReserveSlots": "5"}), r)
    queue_metrics.register(metrics, adm)
    assert adm.enabled is False and adm.status_block() is None
    assert effective_class(adm.enabled, "essential", [(b"x-priority", b"background")]) == "normal"
    t0 = trio.current_time()
    ticket = await adm.admit(MODEL, "normal", "batch")
    assert trio.current_time() == t0 and ticket.cls == "normal"
    assert b"priority" not in generate_latest(metrics)


# --- slot waits ----------------------------------------------------------------------------

async def test_essential_goes_past_the_slot_wait_and_normal_waits(autojump_clock):
    a = handle("a", slots=1, max_concurrency=4)
    r = registry(a)
    adm, _ = make(r, Queue__SlotWaitSeconds=20)
    r.start(a, MODEL)  # one sent, holding the only slot
    r.start(a, MODEL)  # this request
    t0 = trio.current_time()
    await adm.waits.wait_slot(a, MODEL, "essential")
    assert trio.current_time() == t0
    await adm.waits.wait_slot(a, MODEL, "normal")  # nobody finishes: sent anyway after the wait
    assert trio.current_time() == t0 + 20
    assert adm.slots.keys() == []


async def test_slot_wait_ends_when_the_slot_frees(autojump_clock):
    a = handle("a", slots=1, max_concurrency=4)
    r = registry(a)
    adm, _ = make(r, Queue__SlotWaitSeconds=20)
    r.start(a, MODEL)
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        async def second():
            r.start(a, MODEL)
            await adm.waits.wait_slot(a, MODEL, "normal")
            assert trio.current_time() == t0 + 3

        n.start_soon(second)
        await trio.sleep(3)
        r.finish(a, MODEL)


async def test_no_slot_wait_when_unset(autojump_clock):
    a = handle("a", slots=1)
    r = registry(a)
    adm, _ = make(r)
    for _ in range(3):
        r.start(a, MODEL)
    t0 = trio.current_time()
    await adm.waits.wait_slot(a, MODEL, "background")
    assert trio.current_time() == t0


# --- visibility ----------------------------------------------------------------------------

PRIORITY_SERIES = ["appliance_priority_reserve_slots", "appliance_priority_waiting",
                   "appliance_priority_held_total",
                   "appliance_priority_released_total", "appliance_priority_timed_out_total",
                   "appliance_priority_requests_total"]


async def test_scrape_and_status_with_priority_on_and_off():
    r = registry(handle("a"))
    off = CollectorRegistry()
    adm_off = Admission(config.load({}), r)
    queue_metrics.register(off, adm_off)
    text = generate_latest(off).decode()
    assert "priority" not in text
    assert "# TYPE appliance_queue_waiting gauge" in text
    assert adm_off.status_block() is None

    adm, on = make(r, Priority__ReserveSlots=2)
    await adm.admit(MODEL, "essential", "ops")
    text = generate_latest(on).decode()
    for name in PRIORITY_SERIES:
        assert name in text
    assert on.get_sample_value("appliance_priority_reserve_slots") == 2
    for cls in ("essential", "normal", "background"):
        assert on.get_sample_value("appliance_priority_waiting", {"class": cls}) == 0
    assert on.get_sample_value("appliance_priority_requests_total", {"class": "essential"}) == 1
    block = adm.status_block()
    assert block["reserve_slots"] == 2
    assert block["essential"] == {"waiting": 0, "held": 0, "released": 0, "timed_out": 0,
                                  "requests": 1}
    assert set(block) == {"reserve_slots", "background_max_wait_seconds", "essential", "normal",
                          "background"}


async def test_reload_turns_the_series_on_and_off():
    r = registry(handle("a"))
    metrics = CollectorRegistry()
    adm = Admission(config.load({}), r)
    queue_metrics.register(metrics, adm)
    adm.reload(config.load({"Priority__Enabled": "true"}))
    assert metrics.get_sample_value("appliance_priority_reserve_slots") == 1
    assert adm.status_block() is not None
    adm.reload(config.load({}))
    assert b"priority" not in generate_latest(metrics)
    assert adm.status_block() is None


async def test_a_place_is_given_back_on_any_exit_and_moves_to_the_least_loaded_other(
        autojump_clock):
    a, b = handle("a"), handle("b")
    r = registry(a, b)
    adm, _ = make(r)
    with pytest.raises(RuntimeError):
        async with adm.place(MODEL, "normal", "c") as p:
            first = p.node
            assert first.in_flight[MODEL] == 1 and p.tried == [first.name]
            second = p.next(2)  # the first given back, the other taken
            assert second is not None and second is not first
            assert first.in_flight[MODEL] == 0 and second.in_flight[MODEL] == 1
            raise RuntimeError("a bug while on the second node")
    assert a.in_flight_total == b.in_flight_total == 0
    async with adm.place(MODEL, "normal", "c") as p:
        p.next(2)
        assert p.next(2) is None  # two nodes tried: no third attempt
        assert p.tried == [p.tried[0], p.tried[1]] and len(set(p.tried)) == 2
    assert a.in_flight_total == b.in_flight_total == 0


def test_reserve_warning_is_pure_arithmetic():
    from appliance.hub.decide.priority import reserve_warning

    assert reserve_warning(1, [2, 2]) == ""
    assert reserve_warning(3, [2, 2]) == ""
    assert "4 places" in reserve_warning(4, [2, 2]) and "never run" in reserve_warning(5, [2, 2])
    assert reserve_warning(8, [2, None]) == ""  # an uncapped node: room for everyone
    assert reserve_warning(0, [0]) == "" and reserve_warning(3, []) == ""


def test_a_reserve_as_large_as_the_fleet_is_said_in_log_and_status(caplog):
    a, b = handle("a", max_concurrency=2), handle("b", max_concurrency=2)
    r = registry(a, b)
    adm, _ = make(r, Priority__ReserveSlots=3)
    r.changed()
    assert "warning" not in adm.status_block()  # 3 reserved of 4 places: background runs
    b.connected = False  # b is lost: 2 places left, all reserved
    r.changed()
    block = adm.status_block()
    assert "2 places" in block["warning"] and "never run" in block["warning"]
    assert sum("Priority__ReserveSlots=3" in m for m in caplog.messages) == 1
    r.changed()  # said once per change, not on every change
    assert sum("Priority__ReserveSlots=3" in m for m in caplog.messages) == 1
    b.connected = True
    r.changed()
    assert "warning" not in adm.status_block()
