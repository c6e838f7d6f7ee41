"""Each key's own hold on an on-demand model (issue 30 item 7, hub/decide/holds.py): a key
that may not manage models shortens or lengthens only its own hold, within the model's
configured idle time, never pinning; `keep_alive: 0` from it ends its hold alone; the model
stays while anyone's hold or the shared idle clock says so. The placement core called
directly, time passed in (no sockets, no clock)."""

from __future__ import annotations

import math

import trio

from appliance.hub.decide import holds
from appliance.hub.decide.actions import Unload
from appliance.hub.decide.placement import Models
from tests.hub.decide.test_control import make
from tests.hub.decide.test_placement import cfg, node, set_state

IDLE = Unload("m", "a", "idle for 60 s")


def loaded(key: str | None = "team", keep: float | None = None, at: float = 0.0):
    """`m` (IdleUnloadSeconds 60) loaded on `a` for one request of `key` at `at`, which
    ends at once with `keep` (what router._route and Control.make_servable do)."""
    core = Models(cfg([{"Name": "m", "IdleUnloadSeconds": 60}]))
    a = node("a", models=["m"])
    core.touch("m", at, None if key is not None else keep, key)  # in use: the idle time
    core.ask("m", [a], at, held=True)
    core.load_done("m", "a", None, at)
    set_state(a, "m", "ready")
    core.touch("m", at, keep, key)  # the work ended
    return core, a


def test_a_keys_short_keep_alive_shortens_its_own_hold() -> None:
    core, a = loaded(keep=5.0)
    assert core.expires_in("m", 1.0) == 4.0
    assert core.plan([a], 4.9) == [] and core.desired("m", 4.9) == 1
    assert core.plan([a], 5.1) == [IDLE]  # its 5 s, not the model's 60 s


async def test_the_control_loop_unloads_when_the_last_hold_ends(nursery, autojump_clock):
    # An on-demand model (300 s idle) loaded for team with keep_alive 5s: unloaded 5 s after
    # team's work (300 s before, its keep_alive ignored); lab's hold keeps it for lab.
    control, _, ops, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500})})
    await nursery.start(control.run)
    await trio.sleep(400)  # past the idle time its first sight gives every model
    await control.make_servable("m", 5.0, key="team")
    control.touch("m", 5.0, "team")  # team's work ended
    await trio.sleep(4)
    assert ops.unloads == []
    await trio.sleep(2)
    assert ops.unloads == [("a", "m")]
    await control.make_servable("m", None, key="lab")
    control.touch("m", None, "lab")  # no keep_alive: the model's 300 s
    await control.make_servable("m", 5.0, key="team")
    control.touch("m", 0, "team")  # team lets go at once
    await trio.sleep(290)
    assert len(ops.unloads) == 1  # still there for lab
    await trio.sleep(20)
    assert len(ops.unloads) == 2


def test_a_keys_keep_alive_never_lengthens_past_the_idle_time_nor_pins() -> None:
    for keep in (3600.0, math.inf):  # "1h", -1
        core, a = loaded(keep=keep)
        assert core.health["m"].keep is None
        assert core.expires_in("m", 0.0) == 60.0
        assert core.plan([a], 59.9) == []
        assert core.plan([a], 60.1) == [IDLE]


def test_the_model_stays_for_the_others_while_anyone_holds_it() -> None:
    core, a = loaded(keep=5.0)
    core.touch("m", 1.0, None, "lab")  # another key, no keep_alive: the idle time
    assert core.plan([a], 30.0) == [] and core.expires_in("m", 30.0) == 31.0
    core.touch("m", 2.0, 0.0, "team")  # team lets go: only its own hold ends
    assert core.plan([a], 60.9) == []
    assert core.plan([a], 61.1) == [IDLE]


def test_keep_alive_0_from_a_key_releases_its_hold_alone() -> None:
    core, a = loaded(keep=None)
    core.touch("m", 1.0, 0.0, "team")  # nobody else holds it: unloaded once idle
    assert core.plan([a], 1.5) == [IDLE]
    core, a = loaded(keep=None)
    core.touch("m", 0.5, 30.0, "lab")
    core.touch("m", 1.0, 0.0, "team")
    assert core.plan([a], 29.0) == []  # lab's hold stays
    assert core.plan([a], 30.6) == [IDLE]


def test_a_key_may_lengthen_its_hold_again_within_the_idle_time() -> None:
    core, a = loaded(keep=5.0)
    core.touch("m", 4.0, 40.0, "team")
    assert core.plan([a], 43.9) == []
    assert core.plan([a], 44.1) == [IDLE]


def test_the_admin_unloads_and_pins_for_everyone() -> None:
    core, a = loaded(keep=None)
    core.touch("m", 1.0, None, "lab")
    core.touch("m", 2.0, 0.0)  # a managing key's keep_alive 0: every hold ends
    assert len(core.health["m"].holds) == 0
    assert core.plan([a], 2.5) == [Unload("m", "a", "idle for 0 s")]
    core, a = loaded(keep=None)
    core.touch("m", 1.0, math.inf)  # pinned for everyone
    core.touch("m", 2.0, 5.0, "team")  # a key's own short hold does not unpin it
    assert core.expires_in("m", 10.0) is None and core.plan([a], 10_000.0) == []


def test_holds_are_bounded_and_ended_ones_go_first() -> None:
    h = holds.Holds()
    for i in range(holds.MAX_HOLDS):
        h.hold(f"k{i}", float(i), 1.5 if i % 2 else 10_000.0)
    h.hold("late", 5_000.0, 60.0)  # the table is full: the ended holds go
    assert "late" in h.ends and len(h) == holds.MAX_HOLDS // 2 + 1
    for i in range(2 * holds.MAX_HOLDS):
        h.hold(f"x{i}", 6_000.0 + i, 60_000.0)
    assert len(h) == holds.MAX_HOLDS  # then the soonest to end
    assert set(h.ends) == {f"x{i}" for i in range(holds.MAX_HOLDS, 2 * holds.MAX_HOLDS)}


def test_an_eviction_counts_a_keys_use_as_recent() -> None:
    # Two idle models on a full node; `big` needs one's room: the one a key used last stays.
    core = Models(cfg([{"Name": "big", "MemoryMb": 2000}]))
    a = node("a", total=4000, models=["big", ("old", 2000, "ready"), ("held", 2000, "ready")])
    a.state.memory_used_mb = 4000
    core.touch("old", 1.0)
    core.touch("held", 2.0, None, "team")  # a key's use: its hold, not the shared clock
    _, acts = core.ask("big", [a], 10.0)
    assert [act.victims for act in acts] == [["old"]]
