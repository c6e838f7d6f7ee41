"""The start-up grace (hub/grace.py) under MockClock, and a request that arrives in it."""

import trio

from appliance.hub.decide.grace import StartupGrace
from appliance.hub.fleet.nodes import Registry
from appliance.wire import ModelState, NodeState


def _state(name, model="m", state="ready"):
    return NodeState(name=name, models=[ModelState(name=model, state=state)])


async def test_grace_is_bounded_by_two_heartbeat_timeouts(autojump_clock):
    reg = Registry()
    reg.upsert("a", "http://a:1", static=True)
    grace = StartupGrace(reg, heartbeat_seconds=2.0)
    start = trio.current_time()
    assert not grace.over()
    await grace.wait_settled(lambda: bool(reg.ready_nodes("m")))
    assert trio.current_time() == start + 12 and grace.over()


async def test_grace_ends_for_a_model_as_soon_as_a_replica_is_ready(autojump_clock):
    reg = Registry()
    a, _ = reg.upsert("a", "http://a:1", static=True)
    b, _ = reg.upsert("b", "http://b:1", static=True)
    grace = StartupGrace(reg, heartbeat_seconds=2.0)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        async def a_answers():
            await trio.sleep(3)
            reg.apply_state(a, _state("a"))

        nursery.start_soon(a_answers)
        await grace.wait_settled(lambda: bool(reg.ready_nodes("m")))
    assert trio.current_time() == start + 3
    assert not grace.over()  # b has not answered: other models still wait


async def test_grace_is_over_once_every_known_node_answered(autojump_clock):
    reg = Registry()
    a, _ = reg.upsert("a", "http://a:1", static=True)
    grace = StartupGrace(reg, heartbeat_seconds=2.0)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        async def a_answers():
            await trio.sleep(1)
            reg.apply_state(a, _state("a", state="available"))  # answered, model not ready

        nursery.start_soon(a_answers)
        await grace.wait_settled(lambda: bool(reg.ready_nodes("m")))
    assert trio.current_time() == start + 1 and grace.over()


async def test_no_node_known_yet_waits_for_announcements(autojump_clock):
    reg = Registry()
    grace = StartupGrace(reg, heartbeat_seconds=0.5)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        async def announced():
            await trio.sleep(2)
            h, _ = reg.upsert("late", "http://late:1", static=False)
            reg.apply_state(h, _state("late", model="only-on-a-node"))

        nursery.start_soon(announced)
        await grace.wait_settled(lambda: bool(reg.ready_nodes("only-on-a-node")))
    assert trio.current_time() == start + 2
