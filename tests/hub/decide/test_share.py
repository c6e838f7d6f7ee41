"""Fair share to the first token (appliance/hub/decide/share.py): while another key of the
class is active, a place is kept back for it, so its next request finds one free; when it
goes quiet the heavy key takes every place again."""

from __future__ import annotations

import trio
import trio.testing

from appliance import config
from appliance.hub.decide.admission import Admission
from appliance.hub.decide.share import ACTIVE_SECONDS, Shares
from tests.harness.admission_fleet import MODEL, handle, registry


def test_cap_keeps_a_place_for_each_other_active_key():
    s = Shares()
    s.arrive(MODEL, "normal", "heavy", 1.0, 0.0)
    assert s.cap(MODEL, "normal", "heavy", 4, 0.0, {}) is None  # alone: no cap
    s.arrive(MODEL, "normal", "light", 1.0, 0.0)
    assert s.cap(MODEL, "normal", "heavy", 4, 1.0, {}) == 3  # one kept back for light
    assert s.cap(MODEL, "normal", "light", 4, 1.0, {"heavy": 20}) == 2  # its share
    # light waits for 3 more: it keeps back up to its weighted share (2)
    assert s.cap(MODEL, "normal", "heavy", 4, 1.0, {"light": 3}) == 2
    # a heavier weight: a bigger share
    s.arrive(MODEL, "normal", "heavy", 3.0, 1.0)
    assert s.cap(MODEL, "normal", "heavy", 8, 1.0, {"light": 8}) == 6
    # light quiet for ACTIVE_SECONDS: heavy takes everything again
    assert s.cap(MODEL, "normal", "heavy", 4, ACTIVE_SECONDS + 0.5, {}) is None
    # a one-place fleet keeps nothing back
    assert s.cap(MODEL, "normal", "heavy", 1, 1.0, {}) == 1
    # no bound known: nothing to count
    assert s.cap(MODEL, "normal", "heavy", None, 1.0, {}) is None


def test_take_and_release_count_places_and_other_classes_do_not_mix():
    s = Shares()
    for k in ("heavy", "light"):
        s.arrive(MODEL, "normal", k, 1.0, 0.0)
    s.arrive(MODEL, "background", "batch", 1.0, 0.0)
    assert [s.take(MODEL, "normal", "heavy", 2, 0.0, {}) for _ in range(2)] == [True, False]
    assert s.take(MODEL, "normal", "light", 2, 0.0, {})
    assert s.take(MODEL, "background", "batch", 2, 0.0, {})  # its class is its own
    s.release(MODEL, "normal", "light", 0.0)
    assert not s.take(MODEL, "normal", "heavy", 2, 1.0, {})  # light is still active lately
    assert s.take(MODEL, "normal", "heavy", 2, ACTIVE_SECONDS + 1, {})
    assert s.kept == 2


async def test_a_light_key_finds_a_place_beside_a_heavy_one(autojump_clock):
    """Two nodes of two places: the heavy key keeps 16 long requests going; a light one
    sends a short one now and then. Each light request starts at once; while the light key
    is quiet for ACTIVE_SECONDS the heavy key holds all four places again."""
    a, b = handle("a", slots=2), handle("b", slots=2)
    adm = Admission(config.load({"Queue__MaxWaitSeconds": "1000",  # two keys: shares apply
                                 "Auth__Clients__0__Name": "heavy", "Auth__Clients__0__Key": "kh",
                                 "Auth__Clients__1__Name": "light", "Auth__Clients__1__Key": "kl"}),
                    registry(a, b))
    # room counts concurrency: a node's concurrency is its two places here
    for h in (a, b):
        h.state.max_concurrency = 2
    adm._on_change()
    light_waits: list[float] = []
    held_most: list[int] = []

    async def heavy_one() -> None:
        async with adm.place(MODEL, "normal", "heavy"):
            await trio.sleep(5)

    async def heavy() -> None:
        async with trio.open_nursery() as n:
            for _ in range(16):
                n.start_soon(heavy_one)
                await trio.sleep(0.01)

    async def light_one() -> None:
        t = trio.current_time()
        async with adm.place(MODEL, "normal", "light"):
            light_waits.append(trio.current_time() - t)
            await trio.sleep(0.2)

    async def watch() -> None:
        while True:
            k = adm.shares.groups[(MODEL, "normal")].keys.get("heavy")
            held_most.append(k.held if k is not None else 0)
            await trio.sleep(0.05)

    async with trio.open_nursery() as n:
        n.start_soon(light_one)  # the light key has been seen
        await trio.sleep(1)
        n.start_soon(heavy)
        n.start_soon(watch)
        for _ in range(4):
            await trio.sleep(2)
            n.start_soon(light_one)
        await trio.sleep(1)
        assert max(held_most) == 3  # one place kept back while light is active
        held_most.clear()
        await trio.sleep(ACTIVE_SECONDS + 6)
        assert max(held_most) == 4  # light quiet: heavy takes all four
        n.cancel_scope.cancel()
    assert light_waits == [0.0] * 5


def test_one_tenant_keeps_nothing_back():
    """No Auth__Clients: every request is the anonymous key's, so no place is kept back
    for another key and share.py is not asked (a reload that adds clients turns it on)."""
    adm = Admission(config.load({}), registry(handle("a", slots=2)))
    assert adm.core.share is None
    adm.reload(config.load({"Auth__Clients__0__Name": "x", "Auth__Clients__0__Key": "kx"}))
    assert adm.core.share is not None


async def test_the_kept_place_returns_when_the_light_key_goes_quiet(autojump_clock):
    """One node of four places, the heavy key's requests each an hour long: while the light
    key is active one place is kept back for it; ACTIVE_SECONDS after its last request the
    heavy key's waiting request takes that place at once, not an hour later when one of
    its own ends (the old behaviour: the kept place came back only at a finished request)."""
    a = handle("a", slots=4)
    adm = Admission(config.load({"Queue__MaxWaitSeconds": "100000",
                                 "Auth__Clients__0__Name": "heavy", "Auth__Clients__0__Key": "kh",
                                 "Auth__Clients__1__Name": "light", "Auth__Clients__1__Key": "kl"}),
                    registry(a))
    a.state.max_concurrency = 4
    adm._on_change()
    started: list[float] = []

    async def heavy_one() -> None:
        async with adm.place(MODEL, "normal", "heavy"):
            started.append(trio.current_time())
            await trio.sleep(3600)

    async with trio.open_nursery() as n:
        async with adm.place(MODEL, "normal", "light"):
            await trio.sleep(1)
        light_done = trio.current_time()
        for _ in range(4):
            n.start_soon(heavy_one)
        await trio.sleep(1)
        assert len(started) == 3  # one place kept back for the light key
        await trio.sleep(ACTIVE_SECONDS)
        assert len(started) == 4
        assert started[-1] - light_done <= ACTIVE_SECONDS + 0.01  # at the quiet point
        n.cancel_scope.cancel()


def test_quiet_at_is_when_the_next_idle_key_stops_counting():
    s = Shares()
    assert s.quiet_at(MODEL, "normal", 0.0) is None
    s.arrive(MODEL, "normal", "heavy", 1.0, 0.0)
    s.arrive(MODEL, "normal", "light", 1.0, 2.0)
    assert s.take(MODEL, "normal", "heavy", 4, 2.0, {})
    assert s.quiet_at(MODEL, "normal", 3.0) == 2.0 + ACTIVE_SECONDS  # heavy holds: not it
    assert s.quiet_at(MODEL, "normal", 2.0 + ACTIVE_SECONDS) is None  # light is quiet now
