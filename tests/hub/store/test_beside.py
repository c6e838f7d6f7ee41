"""Batch lines stepping aside for other work (hub/store/beside.py), on a virtual clock:
Batch__BesidePercent (a quarter) of Batch__MaxConcurrent while essential or normal requests arrive or wait, all
of it once they have been quiet for QUIET_SECONDS; with priority off, the hub's own lines
are not other work."""

from __future__ import annotations

import pytest
import trio

from appliance.config import ConfigError, load
from appliance.hub.store import beside
from appliance.hub.store.beside import Arrivals, Beside


async def test_lines_narrow_while_other_work_arrives_and_widen_when_quiet(autojump_clock):
    a = Arrivals(0, False, 0)
    b = Beside(lambda: a)
    assert b.allowed(8) == 8  # nothing about
    a = Arrivals(1, False, 0)  # an essential chat arrived
    assert b.allowed(8) == 2 and b.allowed(1) == 1
    await trio.sleep(beside.QUIET_SECONDS / 2)
    assert b.allowed(8) == 2
    await trio.sleep(beside.QUIET_SECONDS)
    assert b.allowed(8) == 8  # quiet again
    a = Arrivals(1, False, 3)  # none arrived, but some wait for a place
    assert b.allowed(8) == 2
    a = Arrivals(1, False, 0)
    await trio.sleep(2 * beside.QUIET_SECONDS)
    assert b.allowed(8) == 8


async def test_room_waits_for_a_line_to_end_while_narrowed(autojump_clock):
    a = Arrivals(0, False, 0)
    b = Beside(lambda: a)
    b.allowed(8)
    for _ in range(2):
        await b.room(8)
        b.started()
    a = Arrivals(5, False, 0)
    went = trio.Event()

    async def third() -> None:
        await b.room(8)
        went.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.sleep(0.5)
        assert not went.is_set()  # 2 of 8 in flight, other work about
        b.ended()
        await trio.sleep(0.01)
        assert went.is_set()


async def test_priority_off_the_hubs_own_lines_are_not_other_work(autojump_clock):
    total = 0
    b = Beside(lambda: Arrivals(total, True, 0))
    assert b.allowed(8) == 8
    for _ in range(5):  # each line counted as started, then arriving at admission
        b.started()
        assert b.allowed(8) == 8
        total += 1
        assert b.allowed(8) == 8
    total += 1  # one that is not a line
    assert b.allowed(8) == 2


def test_no_counts_never_steps_aside():
    assert Beside(None).allowed(8) == 8


async def test_the_share_while_others_are_about_is_batch_besidepercent(autojump_clock):
    assert load({}).batch.beside_percent == 25
    assert load({"Batch__BesidePercent": "100"}).batch.beside_percent == 100
    with pytest.raises(ConfigError):
        load({"Batch__BesidePercent": "101"})
    b = Beside(lambda: Arrivals(1, False, 1))  # others wait now
    assert b.allowed(8, 100) == 8 and b.allowed(8, 50) == 4 and b.allowed(8, 0) == 1
    assert b.allowed(8) == 2  # the default quarter
