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


async def test_an_essential_request_granted_in_its_own_dispatch_preempts_nothing(
        autojump_clock) -> None:
    # Mutant: the preempt check without `not w.granted`. Reachable through the fair share
    # (share.py): key A's essential request waits with a place free -- kept back for the
    # other active essential keys -- so the next essential request, from B, queues behind
    # it (one waits ahead) and is granted by the very dispatch its arrival runs. B has its
    # place: the background request still running must not be preempted for it.
    r = registry(handle("a", slots=None, max_concurrency=6))
    adm, _ = make(r, Priority__Preempt="true", Priority__ReserveSlots=0,
                  Auth__Clients__0__Name="ops", Auth__Clients__0__Key="k")
    log: list = []
    bg_old, bg_new = Req(), Req()
    a_reqs = [Req() for _ in range(4)]
    b = Req()
    async with trio.open_nursery() as n:
        for key in ("B", "C", "D"):  # three more essential keys, active for 10 s
            quick = Req()
            quick.done.set()
            n.start_soon(hold, adm, "essential", key, quick, log)
        await trio.sleep(1)
        n.start_soon(hold, adm, "background", "batch", bg_old, log)
        await trio.sleep(1)
        n.start_soon(hold, adm, "background", "batch", bg_new, log)
        await trio.sleep(1)
        for req in a_reqs[:3]:  # A's share: 6 places less one kept for each of B, C, D
            n.start_soon(hold, adm, "essential", "A", req, log)
        await trio.sleep(1)
        assert log.count("A") == 3 and r.nodes["a"].in_flight_total == 5
        n.start_soon(hold, adm, "essential", "A", a_reqs[3], log)  # kept back: it waits
        await trio.sleep(1)
        # Waiting, it took the newest background request's place (the rule itself) ...
        assert bg_new.preempted and not bg_old.preempted and log.count("A") == 3
        n.start_soon(hold, adm, "essential", "B", b, log)
        await trio.sleep(1)
        # ... B, granted at once behind it, takes nothing from the older one.
        assert log[-1] == "B" and not bg_old.preempted and adm.victims.preempted == 1
        for req in (b, bg_old, *a_reqs):
            req.done.set()
