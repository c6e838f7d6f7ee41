"""Priority__EssentialSlots: places per model only essential work may take, held against
normal and background alike (issue 30 item 4, DESIGN 9.3)."""

from __future__ import annotations

import trio

from appliance.hub.decide.priority import AdmissionCore, Fleet
from tests.harness.admission_fleet import MODEL, handle, registry
from tests.hub.decide.test_admission import go, make


def core(essential: int, reserve: int = 1) -> AdmissionCore:
    return AdmissionCore(enabled=True, reserve=reserve, max_depth=100, max_wait=30,
                         background_max_wait=60, essential=essential)


def test_each_class_leaves_what_it_must() -> None:
    c = core(essential=2)
    assert c.may_go("normal", Fleet(places=3, room=3))
    assert not c.may_go("normal", Fleet(places=2, room=2))  # the essential two
    assert c.may_go("essential", Fleet(places=1, room=1))
    assert not c.may_go("background", Fleet(places=3, room=3))  # reserve 1 + essential 2
    assert c.may_go("background", Fleet(places=4, room=4))
    off = core(essential=0)
    assert off.may_go("normal", Fleet(places=1, room=1))  # 0: normal as before
    assert not off.may_go("background", Fleet(places=1, room=1))


async def test_essential_work_finds_its_places_past_a_full_house_of_normal(autojump_clock):
    # One node of 3 places, 2 of them essential's: normal streams take one place and wait
    # for it; an essential request goes at once (8 s behind normal streams, before).
    r = registry(handle("a", slots=None, max_concurrency=3))
    adm, _ = make(r, Priority__EssentialSlots=2)
    log: list = []
    done = trio.Event()
    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        for i in range(3):
            n.start_soon(go, adm, r, MODEL, "normal", f"team{i}", log, done)
        await trio.sleep(1)
        assert len(log) == 1  # one normal; the others wait: 2 places are essential's
        n.start_soon(go, adm, r, MODEL, "essential", "ops", log, done)
        n.start_soon(go, adm, r, MODEL, "essential", "ops2", log, done)
        await trio.sleep(1)
        assert sorted(c for c, _ in log[1:]) == ["ops", "ops2"]
        assert [t - t0 for _, t in log] == [0, 1, 1]
        done.set()
    assert len(log) == 5


def test_the_starved_background_warning_counts_the_essential_places() -> None:
    from appliance.hub.decide.priority import reserve_warning

    assert reserve_warning(1, [2, 2], essential=2) == ""  # 3 of 4 held: background runs
    why = reserve_warning(1, [2, 2], essential=3)  # 1 + 3 = the fleet's 4 places
    assert "Priority__EssentialSlots=3" in why and "background requests can never run" in why
    why = reserve_warning(0, [2, 2], essential=4)  # normal has no place either
    assert "normal and background requests can never run" in why
    assert reserve_warning(0, [2, None], essential=9) == ""  # an uncapped node


def test_essential_places_that_starve_background_are_said_in_log_and_status(caplog) -> None:
    a, b = handle("a", max_concurrency=2), handle("b", max_concurrency=2)
    r = registry(a, b)
    adm, _ = make(r, Priority__ReserveSlots=1, Priority__EssentialSlots=2)
    r.changed()
    assert "warning" not in adm.status_block()  # 3 of 4 places held: background runs
    b.connected = False  # 2 places left, all held for essential work and the reserve
    r.changed()
    block = adm.status_block()
    assert "never run" in block["warning"] and "Priority__EssentialSlots=2" in block["warning"]
    assert sum("Priority__EssentialSlots=2" in m for m in caplog.messages) == 1
    b.connected = True
    r.changed()
    assert "warning" not in adm.status_block()
