"""Preemption mutants that survived issue 30's round (item 10), one test each: the rule
(preempt.Victims) and admission's use of it, with normal-class clients configured beside
background and essential ones (no test had one)."""

from __future__ import annotations

import trio

from appliance.hub.decide.admission import Admission
from appliance.hub.decide.preempt import Victims
from tests.harness.admission_fleet import MODEL, handle, registry
from tests.hub.decide.test_admission import make


class Req:
    """A request as preemption sees it; `preempt` ends its place as the relay would."""

    def __init__(self, started: bool = False) -> None:
        self.started, self.preempted = started, False
        self.done = trio.Event()

    def first_byte(self) -> bool:
        return self.started

    def preempt(self) -> None:
        self.preempted = True
        self.done.set()


async def hold(adm: Admission, cls: str, client: str, req: Req, log: list) -> None:
    async with adm.place(MODEL, cls, client, victim=req):
        log.append(client)
        await req.done.wait()


async def arrive(n: trio.Nursery, adm: Admission, cls: str, client: str, req: Req, log: list,
                 then: float = 1) -> None:
    """`client` asks for a place (class `cls`, held as `req`); `then` virtual seconds pass."""
    n.start_soon(hold, adm, cls, client, req, log)
    await trio.sleep(then)


def test_the_newest_of_two_without_a_first_byte_is_preempted() -> None:
    # Mutant: the oldest held request picked instead of the newest.
    v = Victims()
    old, new = Req(), Req()
    v.hold("m", old)
    v.hold("m", new)
    assert v.preempt_one("m") is new and new.preempted and not old.preempted


def one_place_fleet() -> tuple[Admission, object]:
    r = registry(handle("a", slots=None, max_concurrency=1))
    adm, _ = make(r, Priority__Preempt="true", Priority__ReserveSlots=0)
    return adm, r


async def test_a_normal_waiter_preempts_nothing(autojump_clock) -> None:
    # Mutant: any waiter, not only essential work, takes a background request's place.
    adm, _ = one_place_fleet()
    bg, normal, log = Req(), Req(), []
    async with trio.open_nursery() as n:
        await arrive(n, adm, "background", "batch", bg, log)
        await arrive(n, adm, "normal", "team", normal, log, then=5)
        assert not bg.preempted and log == ["batch"]
        bg.done.set()
        await trio.sleep(1)
        assert log == ["batch", "team"]
        normal.done.set()


async def test_only_background_work_is_held_as_a_victim(autojump_clock) -> None:
    # Mutant: every class held as a victim: essential work then preempts a normal request.
    adm, _ = one_place_fleet()
    normal, ess, log = Req(), Req(), []
    async with trio.open_nursery() as n:
        await arrive(n, adm, "normal", "team", normal, log)
        assert adm.victims.held(MODEL) == 0
        await arrive(n, adm, "essential", "ops", ess, log, then=5)
        assert not normal.preempted and log == ["team"]
        normal.done.set()
        await trio.sleep(1)
        ess.done.set()
    assert log == ["team", "ops"]


async def test_a_finished_victim_is_released(autojump_clock) -> None:
    # Mutant: a background request that ended stays held; a later essential request
    # "preempts" it (a request long gone) instead of waiting for a real place.
    adm, _ = one_place_fleet()
    bg, log = Req(), []
    async with trio.open_nursery() as n:
        await arrive(n, adm, "background", "batch", bg, log)
        assert adm.victims.held(MODEL) == 1
        bg.done.set()
        await trio.sleep(1)
    assert adm.victims.held(MODEL) == 0 and adm.victims.preempted == 0


async def test_an_essential_request_with_a_place_preempts_nothing(autojump_clock) -> None:
    # Essential work granted a place on arrival (the reserved one, past a background
    # request the reserve holds back) leaves the running background request alone.
    r = registry(handle("a", slots=None, max_concurrency=2))
    adm, _ = make(r, Priority__Preempt="true", Priority__ReserveSlots=1)
    bg, bg2, ess, log = Req(), Req(), Req(), []
    async with trio.open_nursery() as n:
        await arrive(n, adm, "background", "batch", bg, log)
        await arrive(n, adm, "background", "batch", bg2, log)  # held by the reserve
        assert log == ["batch"]
        await arrive(n, adm, "essential", "ops", ess, log)
        assert log == ["batch", "ops"] and not bg.preempted and adm.victims.preempted == 0
        for req in (bg, ess, bg2):
            req.done.set()
            await trio.sleep(1)


async def test_an_essential_waiter_takes_the_background_place(autojump_clock) -> None:
    # The rule itself, for contrast: a waiting essential request preempts the background one.
    adm, _ = one_place_fleet()
    bg, ess, log = Req(), Req(), []
    async with trio.open_nursery() as n:
        await arrive(n, adm, "background", "batch", bg, log)
        await arrive(n, adm, "essential", "ops", ess, log)
        assert bg.preempted and log == ["batch", "ops"]
        ess.done.set()
