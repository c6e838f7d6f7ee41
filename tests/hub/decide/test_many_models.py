"""A node with thousands of models does not wedge the control loop (issue 30 item 2).

An `Engine__Kind=openai` node in front of an aggregator listing ~2,000 ids: each pass of
the loop looked every model up by scanning the node's list (quadratic: 0.4 s a pass at
2,005), and the idle-unload pass then unloaded all of them one by one -- from an engine
that cannot unload anything. Proven here by counting, not by timing: a pass reads each
node's model list a bounded number of times, a fixed upstream's models are never
idle-unloaded, and elsewhere at most MAX_IDLE_UNLOADS unloads run at once.
"""

from __future__ import annotations

import trio

from appliance.hub.decide.actions import Unload
from appliance.hub.decide.control import MAX_IDLE_UNLOADS, Control
from appliance.hub.decide.placement import Models
from appliance.hub.fleet.nodes import Registry
from appliance.wire import ModelState, NodeState
from tests.hub.decide.test_control import FakeAudit, FakeOps
from tests.hub.decide.test_placement import cfg

MANY = 2005


class CountingList(list):
    """A model list that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        CountingList.walks += 1
        return super().__iter__()


def fleet(kind: str, n: int = MANY, size: int = 1) -> tuple[Registry, NodeState]:
    reg = Registry()
    h, _ = reg.upsert("evil", "http://evil:1", static=True)
    state = NodeState(name="evil", engine=kind, memory_total_mb=10**6, memory_used_mb=0,
                      models=CountingList(ModelState(f"m{i:04}", size, state="ready")
                                          for i in range(n)))
    reg.apply_state(h, state)
    return reg, state


def test_a_pass_walks_each_nodes_models_a_bounded_number_of_times():
    reg, _ = fleet("ollama")
    core = Models(cfg([]))
    nodes = list(reg.nodes.values())
    core.plan(nodes, 0.0)
    CountingList.walks = 0
    acts = core.plan(nodes, 1000.0)  # every model idle past its 300 s
    assert len(acts) == MANY and all(isinstance(a, Unload) for a in acts)
    # Linear: the list is walked a few times per pass, not once per model (2,005+).
    assert CountingList.walks <= 10


def test_a_fixed_upstreams_models_are_never_idle_unloaded():
    reg, _ = fleet("openai")
    core = Models(cfg([]))
    nodes = list(reg.nodes.values())
    core.plan(nodes, 0.0)
    assert core.plan(nodes, 1000.0) == []
    assert core.plan(nodes, 10**6) == []


def test_a_fixed_upstreams_models_are_no_victims_either():
    reg, _ = fleet("openai", 3, size=400)  # idle, 1,200 MiB: room enough were they victims
    h = reg.nodes["evil"]
    h.state.memory_total_mb, h.state.memory_used_mb = 1000, 1000
    core = Models(cfg([{"Name": "new", "MemoryMb": 500, "Source": "x"}]))
    _, acts = core.ask("new", [h], 1000.0)
    assert acts == [] and "needs 500 MiB" in core.reason("new", 1000.0)


async def test_idle_unloads_run_a_bounded_few_at_once_and_all_end(nursery, autojump_clock):
    reg, _ = fleet("ollama", 50)
    ops, audit = FakeOps(reg), FakeAudit()
    ops.unload_seconds = 1.0
    running, most = 0, 0
    unload = ops.unload

    async def counted(h, model):
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            await unload(h, model)
        finally:
            running -= 1

    ops.unload = counted
    control = Control(cfg([]), reg, None, audit, ops=ops)
    await nursery.start(control.run)
    await trio.sleep(301)  # idle past the default 300 s
    assert most == MAX_IDLE_UNLOADS
    await trio.sleep(60)
    assert len(ops.unloads) == 50 and most == MAX_IDLE_UNLOADS
    assert not [m for m in reg.nodes["evil"].state.models if m.state == "ready"]


async def test_an_openai_node_with_thousands_of_idle_models_sees_no_unload(nursery,
                                                                           autojump_clock):
    reg, _ = fleet("openai")
    ops, audit = FakeOps(reg), FakeAudit()
    control = Control(cfg([], Hub__ControlIntervalSeconds=30), reg, None, audit, ops=ops)
    await nursery.start(control.run)
    await trio.sleep(400)  # idle past the default 300 s
    assert ops.unloads == [] and "model_unload" not in audit.kinds()
    assert len(reg.ready_nodes("m1999")) == 1


def test_node_state_model_is_an_index_that_follows_the_list():
    st = NodeState(name="n", models=[ModelState("a"), ModelState("b"), ModelState("a", 7)])
    assert st.model("a") is st.models[0] and st.model("zz") is None
    st.models.append(ModelState("c"))
    assert st.model("c") is st.models[3]
    st.models = [ModelState("d")]
    assert st.model("a") is None and st.model("d") is st.models[0]
    assert st == NodeState(name="n", models=[ModelState("d")])  # the index is no field
