"""The start-up grace (hub/grace.py) under MockClock, and a request that arrives in it."""

from collections.abc import Callable

import trio

from appliance.hub.decide.grace import StartupGrace
from appliance.hub.fleet.nodes import Registry
from appliance.wire import ModelState, NodeState


def _state(name, model="m", state="ready"):
    return NodeState(name=name, models=[ModelState(name=model, state=state)])


def _grace(*static: str, heartbeat: float = 2.0):
    """A registry of the `static` nodes (none answered yet), its grace, and their handles."""
    reg = Registry()
    handles = [reg.upsert(name, f"http://{name}:1", static=True)[0] for name in static]
    return reg, StartupGrace(reg, heartbeat_seconds=heartbeat), handles


async def _waited(grace: StartupGrace, reg: Registry, model: str = "m", after: float = 0.0,
                  then: Callable[[], None] | None = None) -> float:
    """How long (virtual) a request for `model` waits in the grace, `then()` run `after` s."""
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        if then is not None:
            async def later() -> None:
                await trio.sleep(after)
                then()

            nursery.start_soon(later)
        await grace.wait_settled(lambda: bool(reg.ready_nodes(model)))
    return trio.current_time() - start


async def test_grace_is_bounded_by_two_heartbeat_timeouts(autojump_clock):
    reg, grace, _ = _grace("a")
    assert not grace.over()
    assert await _waited(grace, reg) == 12 and grace.over()


async def test_grace_ends_for_a_model_as_soon_as_a_replica_is_ready(autojump_clock):
    reg, grace, (a, _) = _grace("a", "b")
    assert await _waited(grace, reg, after=3, then=lambda: reg.apply_state(a, _state("a"))) == 3
    assert not grace.over()  # b has not answered: other models still wait


async def test_grace_is_over_once_every_known_node_answered(autojump_clock):
    reg, grace, (a,) = _grace("a")
    # a answers at 1 s, the model not ready
    assert await _waited(grace, reg, after=1, then=lambda: reg.apply_state(
        a, _state("a", state="available"))) == 1
    assert grace.over()


async def test_no_node_known_yet_waits_for_announcements(autojump_clock):
    reg, grace, _ = _grace(heartbeat=0.5)

    def announced() -> None:
        h, _ = reg.upsert("late", "http://late:1", static=False)
        reg.apply_state(h, _state("late", model="only-on-a-node"))

    assert await _waited(grace, reg, "only-on-a-node", after=2, then=announced) == 2
