"""Replicas that follow demand (appliance/hub/decide/demand.py, placement.py): an
on-demand model whose predicted wait stays long gets a second replica on a node with
room, up to Models__N__MaxReplicas; once the wait falls, idle unload takes it back."""

from __future__ import annotations

from appliance.hub.decide.actions import Load, Unload
from appliance.hub.decide.demand import DEMAND_HOLD_SECONDS, DEMAND_WAIT_SECONDS, ReplicaDemand
from appliance.hub.decide.placement import Models
from tests.hub.decide.test_placement import cfg, node, set_state

DEEP = DEMAND_WAIT_SECONDS * 4  # a deep queue's predicted wait


def test_demand_grows_only_when_held_and_placed():
    d = ReplicaDemand()
    d.observe("m", DEEP, 0.0)
    assert not d.grow("m", 1, 3, 1.0)  # a burst, not held yet
    d.observe("m", DEEP, DEMAND_HOLD_SECONDS)
    assert d.grow("m", 1, 3, DEMAND_HOLD_SECONDS) and d.target("m") == 2
    d.observe("m", DEEP, 2 * DEMAND_HOLD_SECONDS)
    assert not d.grow("m", 1, 3, 2 * DEMAND_HOLD_SECONDS)  # the second is not placed yet
    assert d.grow("m", 2, 3, 2 * DEMAND_HOLD_SECONDS)
    d.observe("m", DEEP, 3 * DEMAND_HOLD_SECONDS)
    assert not d.grow("m", 3, 3, 3 * DEMAND_HOLD_SECONDS)  # at Models__N__MaxReplicas
    # no requests for a while: an old observation says nothing
    assert not d.pressed("m", 5 * DEMAND_HOLD_SECONDS)


def test_a_second_replica_for_a_deep_queue_and_its_idle_unload():
    core = Models(cfg([{"Name": "m", "MaxReplicas": 2, "IdleUnloadSeconds": 60}]))
    a = node("a", models=[("m", 1000, "available")])
    b = node("b", models=[("m", 1000, "available")])
    nodes = [a, b]
    _, acts = core.ask("m", nodes, 0.0)
    assert [type(x) for x in acts] == [Load]
    first = acts[0].node
    set_state(a if first == "a" else b, "m", "ready")
    core.load_done("m", first, None, 0.0)
    assert core.plan(nodes, 1.0) == []  # one replica, no queue: nothing more
    t = 2.0
    while t < 2.0 + DEMAND_HOLD_SECONDS:  # requests keep coming, each predicting a long wait
        core.demand.observe("m", DEEP, t)
        core.touch("m", t)
        assert core.plan(nodes, t) == []
        t += 1.0
    core.demand.observe("m", DEEP, t)
    core.touch("m", t)
    acts = core.plan(nodes, t)  # held past DEMAND_HOLD_SECONDS: one more, on the other node
    assert [(type(x), x.node) for x in acts] == [(Load, "b" if first == "a" else "a")]
    assert core.status("m", nodes, t)["desired"] == 2
    other = acts[0].node
    set_state(a if other == "a" else b, "m", "ready")
    core.load_done("m", other, None, t)
    # the queue drains: short waits; requests end on both nodes
    core.demand.observe("m", 0.1, t + 1)
    core.demand.used(first, "m", t + 1)
    core.demand.used(other, "m", t + 5)
    core.touch("m", t + 5)
    assert core.plan(nodes, t + 30) == []  # not idle for 60 s yet
    acts = core.plan(nodes, t + 62)
    assert [(type(x), x.node) for x in acts] == [(Unload, first)]  # the one idle longest
    assert core.status("m", nodes, t + 62)["desired"] == 1


def test_max_replicas_1_is_todays_one_replica():
    core = Models(cfg([{"Name": "m"}]))
    a = node("a", models=[("m", 1000, "ready")])
    b = node("b", models=[("m", 1000, "available")])
    core.ask("m", [a, b], 0.0)
    for t in range(0, 60, 5):
        core.demand.observe("m", DEEP, float(t))
        assert core.plan([a, b], float(t)) == []
