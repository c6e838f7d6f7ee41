"""NodeStateKeeper: limits, switches, the change counter, over-limits, merged model states."""

import pytest
import trio

from appliance.config import NodeConfig
from appliance.node.changes import ChangeWaiter
from appliance.node.state import NodeStateKeeper, NoPlace, parse_nvidia_smi
from appliance.wire import EngineInstall, ModelState


class FakeEngine:
    kind = "sim"

    def __init__(self, models=None, used=0):
        self._models = models if models is not None else [ModelState("m1", size_mb=500)]
        self.used = used

    def installs(self):
        return [EngineInstall("sim", "1.0")]

    def models(self):
        return self._models

    def memory_used_mb(self):
        return self.used


def keeper(engine=None, **node):
    return NodeStateKeeper("gpu-a", NodeConfig(**node), engine or FakeEngine())


def test_defaults_published():
    k = keeper()
    st = k.snapshot()
    assert st.name == "gpu-a"
    assert st.engines == [EngineInstall("sim", "1.0")]
    assert st.max_concurrency is None
    assert st.slots == 1
    assert st.memory_total_mb is None and st.memory_used_mb == 0
    assert not st.paused and not st.left and not st.over_limits
    assert [m.name for m in st.models] == ["m1"]


def test_max_concurrency_enforced_and_counted():
    k = keeper(max_concurrency=2)
    k.try_start("m1")
    k.try_start("m2")
    with pytest.raises(NoPlace, match="Node__MaxConcurrency 2"):
        k.try_start("m1")
    st = k.snapshot()
    assert st.in_flight == 2
    assert st.model("m1").in_flight == 1
    k.finish("m2")
    k.try_start("m1")
    assert k.snapshot().model("m1").in_flight == 2
    k.finish("m1")
    k.finish("m1")
    assert k.in_flight == {} and k.in_flight_total == 0


def test_slots_are_published_not_enforced():
    k = keeper(model_slots=1)
    k.try_start("m1")
    k.try_start("m1")
    st = k.snapshot()
    assert st.slots == 1 and st.model("m1").in_flight == 2


def test_paused_left_draining_refuse_but_running_work_finishes():
    k = keeper()
    k.try_start("m1")
    k.set_paused(True)
    with pytest.raises(NoPlace, match="paused"):
        k.try_start("m1")
    assert k.snapshot().paused
    k.finish("m1")
    assert k.snapshot().in_flight == 0
    k.set_paused(False)
    k.set_left(True)
    with pytest.raises(NoPlace, match="left"):
        k.try_start("m1")
    assert k.snapshot().left
    k.set_left(False)
    k.try_start("m1")
    k.drain()
    with pytest.raises(NoPlace, match="shutting down"):
        k.try_start("m1")


def test_change_counter_bumps_only_on_change():
    k = keeper()
    v = k.version
    k.set_paused(False)
    assert k.version == v
    k.set_paused(True)
    assert k.version == v + 1
    with pytest.raises(NoPlace):  # refused: no change
        k.try_start("m1")
    assert k.version == v + 1
    k.set_paused(False)
    assert k.version == v + 2
    # In-flight counts ride on the next heartbeat: no state line per request.
    k.try_start("m1")
    k.finish("m1")
    assert k.version == v + 2
    k.set_gpu_memory((1000, 10))
    k.set_gpu_memory((1000, 10))
    assert k.version == v + 3
    assert k.apply_limits(NodeConfig()) == []
    assert k.version == v + 3


def test_in_flight_publishes_at_once_only_when_it_flips_over_limits():
    k = keeper(max_concurrency=2)
    k.try_start("m1")
    k.try_start("m1")
    v = k.version
    k.apply_limits(NodeConfig(max_concurrency=1))  # a reload lowered the cap: over now
    assert k.over_limits() and k.version > v
    v = k.version
    k.finish("m1")  # 1 in flight, cap 1: no longer over -> published
    assert not k.over_limits() and k.version == v + 1


async def test_wait_changed_wakes_without_polling(autojump_clock):
    k = keeper()
    v = k.version
    woke = []
    waiter_ = ChangeWaiter(k)

    async def waiter():
        await waiter_.wait_changed(v)
        woke.append(trio.current_time())

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.sleep(5)
        assert woke == []
        k.set_paused(True)
    assert woke == [5]
    # Already changed: returns at once.
    with trio.fail_after(0.001):
        await waiter_.wait_changed(v)


def test_over_limits_gpu_memory_above_budget():
    k = keeper(memory_mb=20000)
    k.set_gpu_memory((24000, 23000))
    st = k.snapshot()
    assert st.over_limits
    assert st.over_limits_reason == "GPU memory used 23000 MiB is over Node__MemoryMb 20000"
    assert st.memory_total_mb == 20000 and st.memory_used_mb == 23000
    k.set_gpu_memory((24000, 5000))
    st = k.snapshot()
    assert not st.over_limits and st.over_limits_reason == ""


def test_memory_measured_without_budget_is_never_over():
    k = keeper()
    k.set_gpu_memory((48000, 47000))
    st = k.snapshot()
    assert (st.memory_total_mb, st.memory_used_mb) == (48000, 47000)
    assert not st.over_limits


def test_memory_declared_without_gpu_uses_engine_account():
    k = keeper(FakeEngine(used=1200), memory_mb=8000)
    st = k.snapshot()
    assert (st.memory_total_mb, st.memory_used_mb) == (8000, 1200)
    assert not st.over_limits


def test_lowered_concurrency_by_reload_is_over_limits():
    k = keeper(max_concurrency=3)
    for _ in range(3):
        k.try_start("m1")
    changes = k.apply_limits(NodeConfig(max_concurrency=2, model_slots=4))
    assert changes == ["Node__MaxConcurrency 3 -> 2", "Node__ModelSlots 1 -> 4"]
    st = k.snapshot()
    assert st.over_limits and "over Node__MaxConcurrency 2" in st.over_limits_reason
    assert st.slots == 4
    k.finish("m1")
    k.finish("m1")
    assert not k.snapshot().over_limits


def test_load_overlay_loading_failed_ready():
    eng = FakeEngine([ModelState("m1", size_mb=500)])
    k = keeper(eng)
    k.load_started("m1")
    assert k.snapshot().model("m1").state == "loading"
    k.load_failed("m1", "health never came in 120 s")
    m = k.snapshot().model("m1")
    assert (m.state, m.last_error) == ("failed", "health never came in 120 s")
    # The engine's own word wins once it has one.
    eng._models = [ModelState("m1", size_mb=500, state="ready")]
    assert k.snapshot().model("m1").state == "ready"
    eng._models = [ModelState("m1", size_mb=500)]
    k.load_started("m1")
    k.load_done("m1")
    assert k.snapshot().model("m1").state == "available"


def test_failed_load_of_unknown_model_still_shows():
    k = keeper()
    k.load_started("org/model:q4")
    assert k.snapshot().model("org/model:q4").state == "loading"
    k.load_failed("org/model:q4", "unknown model architecture: 'kev'")
    m = k.snapshot().model("org/model:q4")
    assert m.state == "failed" and "kev" in m.last_error
    k.unloaded("org/model:q4")
    assert k.snapshot().model("org/model:q4") is None


def test_parse_nvidia_smi():
    assert parse_nvidia_smi("24576, 1000\n24576, 2000\n") == (49152, 3000)
    assert parse_nvidia_smi("") is None
    assert parse_nvidia_smi("[N/A], [N/A]\n") is None
    assert parse_nvidia_smi("NVIDIA-SMI has failed\n") is None
