"""The placement core, called directly: no sockets, no trio, time passed in."""

from __future__ import annotations

import logging

import pytest

from appliance import config
from appliance.hub.decide.actions import Load, Unload
from appliance.hub.decide.placement import Models
from appliance.hub.fleet.nodes import NodeHandle
from appliance.wire import EngineInstall, ModelState, NodeState


def node(name: str, total: int | None = 8000, used: int = 0, models=(),
         up: bool = True, kind: str = "sim") -> NodeHandle:
    """A connected node; `models` are (name, size_mb, state) or names (available, 1000 MiB)."""
    h = NodeHandle(name, f"http://{name}:9090", static=True)
    ms = [ModelState(m, 1000) if isinstance(m, str) else ModelState(m[0], m[1], m[2])
          for m in models]
    h.state = NodeState(name=name, engines=[EngineInstall(kind, "0.1")], engine=kind,
                        memory_total_mb=total, memory_used_mb=used, models=ms)
    h.connected = up
    return h


def cfg(models: list[dict], **extra) -> config.Config:
    env = {}
    for i, m in enumerate(models):
        for k, v in m.items():
            env[f"Models__{i}__{k}"] = str(v)
    env.update({k: str(v) for k, v in extra.items()})
    return config.load(env)


def set_state(h: NodeHandle, model: str, state: str, size: int | None = None) -> None:
    m = h.state.model(model)
    if m is None:
        h.state.models.append(m := ModelState(model, size or 1000))
    m.state = state
    h.state.memory_used_mb = sum(x.size_mb for x in h.state.models if x.state in ("ready",
                                                                                  "loading"))


def test_places_on_most_free_memory_with_size_headroom():
    core = Models(cfg([{"Name": "m"}]))
    a = node("a", total=8000, used=6000, models=[("m", 1000, "available")])
    b = node("b", total=8000, used=1000, models=[("m", 1000, "available")])
    gen, acts = core.ask("m", [a, b], 0.0)
    assert gen == 1 and len(acts) == 1 and acts[0].node == "b" and acts[0].victims == []
    assert core.pending[0].need == 1200  # size x 1.2
    st = core.status("m", [a, b], 0.0)
    assert st["desired"] == 1 and st["loading"] == 1 and st["ready"] == 0


def test_unplaceable_names_the_numbers_and_a_reservation_counts():
    core = Models(cfg([{"Name": "big", "MemoryMb": 9800}, {"Name": "m", "MemoryMb": 5000}]))
    a = node("gpu-a", total=8000, used=100, models=["big", "m"])
    b = node("gpu-b", total=6000, used=0, models=["big", "m"])
    _, acts = core.ask("big", [a, b], 0.0)
    assert acts == []
    assert core.health["big"].unplaceable == "needs 9800 MiB; the most free is 7900 MiB on gpu-a"
    # m goes to gpu-a (7900 free); its reservation leaves 2900 there.
    _, acts = core.ask("m", [a, b], 0.0)
    assert [x.node for x in acts] == ["gpu-a"]
    core.spec("big").memory_mb = 6500
    core.ask("big", [a, b], 0.0)
    assert core.health["big"].unplaceable == "needs 6500 MiB; the most free is 6000 MiB on gpu-b"


def test_no_node_up_and_no_node_with_the_model_are_reasons():
    core = Models(cfg([{"Name": "m"}, {"Name": "src", "Source": "/models/src.gguf",
                                       "MemoryMb": 100}]))
    a = node("a", models=["other"], up=False)
    core.ask("m", [a], 0.0)
    assert core.health["m"].unplaceable == "no node is up (a lost)"
    a.connected = True
    core.ask("m", [a], 0.0)
    assert "no node that is up has it" in core.health["m"].unplaceable
    _, acts = core.ask("src", [a], 0.0)  # a .gguf source: llama.cpp's, and `a` runs the sim
    assert acts == [] and core.health["src"].unplaceable == (
        "needs a llamacpp engine (its .gguf source); no node that is up runs one (a sim)")
    lc = node("lc", models=[], kind="llamacpp")
    _, acts = core.ask("src", [a, lc], 0.0)  # a Source: any capable routable node will do
    assert [(x.node, x.request.source) for x in acts] == [("lc", "/models/src.gguf")]


def test_room_is_made_by_unloading_idle_on_demand_replicas_only():
    core = Models(cfg([{"Name": "big", "MemoryMb": 4000}, {"Name": "always", "Replicas": 1}]))
    a = node("a", total=8000, models=["big", ("old", 2000, "ready"), ("older", 2000, "ready"),
                                       ("busy", 2000, "ready"), ("always", 1500, "ready")])
    a.state.memory_used_mb = 7500
    a.in_flight["busy"] = 1
    core.touch("older", 1.0)
    core.touch("old", 2.0)
    _, acts = core.ask("big", [a], 10.0)
    # 500 free; "older" (least recently used) then "old" give 4500: enough. Never busy or always.
    assert acts == [Load("big", "a", acts[0].request, ["older", "old"])]
    # With the idle ones gone busy too, it is unplaceable and says what unloading would give.
    core2 = Models(cfg([{"Name": "big", "MemoryMb": 4000}, {"Name": "always", "Replicas": 1}]))
    a.in_flight["old"] = 1
    core2.touch("older", 1.0)
    core2.ask("big", [a], 10.0)
    assert core2.health["big"].unplaceable == ("needs 4000 MiB; the most free is 500 MiB on a"
                                               " (2500 MiB with its idle models unloaded)")


def test_parking_after_five_failures_with_capped_backoff():
    c = cfg([{"Name": "kev"}], Models__RetryBackoffMaxSeconds=5)
    core = Models(c)
    a = node("a", models=["kev"])
    err = "unknown model architecture: 'kev'"
    now, delays = 0.0, []
    for i in range(5):
        _, acts = core.ask("kev", [a], now)
        assert len(acts) == 1, i
        core.load_done("kev", "a", err, now)
        h = core.health["kev"]
        if i < 4:
            delays.append(h.next_attempt - now)
            assert core.ask("kev", [a], now)[1] == []  # still in backoff: not tried
            now = h.next_attempt
    assert delays == [1.0, 2.0, 4.0, 5.0]
    h = core.health["kev"]
    assert h.parked and h.failures == 5 and h.last_error == err
    assert core.plan([a], now + 1000) == [] and core.ask("kev", [a], now + 1000)[1] == []
    st = core.status("kev", [a], now)
    assert st["parked"] and st["last_error"] == err and st["consecutive_start_failures"] == 5
    assert st["reason"] == "parked after 5 failed starts in a row"
    assert [k for k, _ in core.events].count("model_parked") == 1


def test_retry_and_definition_change_unpark_and_success_resets():
    core = Models(cfg([{"Name": "kev", "Source": "a.bin"}], Models__ParkAfterFailures=2))
    a = node("a", models=["kev"])
    for t in (0.0, 1.0):
        core.ask("kev", [a], t)
        core.load_done("kev", "a", "boom", t)
    assert core.health["kev"].parked
    assert core.retry("kev", 2.0) and not core.health["kev"].parked
    assert core.health["kev"].failures == 0
    assert len(core.plan([a], 2.0)) == 1  # retry asks for it: tried again
    core.load_done("kev", "a", "boom", 2.0)
    core.ask("kev", [a], 3.0)
    core.load_done("kev", "a", "boom", 3.0)
    assert core.health["kev"].parked
    # Same definition: still parked. A new Source: unparked.
    assert core.reconfigure(cfg([{"Name": "kev", "Source": "a.bin"}],
                                Models__ParkAfterFailures=2)) == []
    assert core.health["kev"].parked
    assert core.reconfigure(cfg([{"Name": "kev", "Source": "b.bin"}],
                                Models__ParkAfterFailures=2)) == ["kev"]
    assert not core.health["kev"].parked
    # One failure, then a success: the count is back to 0.
    core.ask("kev", [a], 10.0)
    core.load_done("kev", "a", "boom", 10.0)
    assert core.health["kev"].failures == 1
    core.ask("kev", [a], 12.0)
    core.load_done("kev", "a", None, 12.0)
    assert core.health["kev"].failures == 0 and core.health["kev"].last_error == ""
    assert not core.retry("nope", 0.0)


def test_profile_args_change_unparks():
    base = {"Profiles__small__Args": "-c 2048"}
    core = Models(cfg([{"Name": "m", "Profile": "small"}], Models__ParkAfterFailures=1, **base))
    a = node("a", models=["m"])
    _, acts = core.ask("m", [a], 0.0)
    assert acts[0].request.args == "-c 2048"
    core.load_done("m", "a", "bad", 0.0)
    assert core.health["m"].parked
    core.reconfigure(cfg([{"Name": "m", "Profile": "small"}], Models__ParkAfterFailures=1,
                         **{"Profiles__small__Args": "-c 4096"}))
    assert not core.health["m"].parked


def test_warning_rate_1000_failed_placements_in_ten_minutes_log_twice(caplog):
    core = Models(cfg([{"Name": "phi-4", "MemoryMb": 9800}]))
    a = node("gpu-a", total=8000, used=100, models=["phi-4"])
    caplog.set_level(logging.WARNING, logger="appliance.hub.decide.placement")
    for i in range(1000):
        core.ask("phi-4", [a], i * 600.0 / 999)  # the last attempt at exactly 600 s
    warnings = [r for r in caplog.records if "no placement" in r.getMessage()]
    assert len(warnings) == 2
    assert "needs 9800 MiB; the most free is 7900 MiB on gpu-a" in warnings[0].getMessage()
    # A changed reason is logged at once.
    a.state.memory_used_mb = 200
    core.ask("phi-4", [a], 601.0)
    assert len([r for r in caplog.records if "no placement" in r.getMessage()]) == 3


def test_on_demand_is_wanted_until_idle_then_unloaded():
    core = Models(cfg([{"Name": "m", "IdleUnloadSeconds": 60}]))
    a = node("a", models=["m"])
    assert core.desired("m", 0.0) == 0
    _, acts = core.ask("m", [a], 0.0)
    core.load_done("m", "a", None, 0.0)
    set_state(a, "m", "ready")
    assert core.plan([a], 1.0) == [] and core.pending == []  # settled: the node shows it ready
    core.touch("m", 30.0)
    assert core.plan([a], 89.0) == [] and core.desired("m", 89.0) == 1
    a.in_flight["m"] = 1
    assert core.plan([a], 95.0) == []  # busy: never unloaded
    a.in_flight["m"] = 0
    assert core.plan([a], 95.0) == [Unload("m", "a", "idle for 60 s")]
    assert core.desired("m", 95.0) == 0


def test_keep_alive_of_the_last_request_replaces_the_idle_time():
    import math

    core = Models(cfg([{"Name": "m", "IdleUnloadSeconds": 60}]))
    a = node("a", models=["m"])
    core.ask("m", [a], 0.0)
    core.load_done("m", "a", None, 0.0)
    set_state(a, "m", "ready")
    core.touch("m", 10.0, keep=math.inf)  # keep_alive -1: until unloaded
    assert core.plan([a], 10_000.0) == [] and core.desired("m", 10_000.0) == 1
    core.touch("m", 10_000.0, keep=600.0)  # a duration: at least that long
    assert core.plan([a], 10_599.0) == []
    assert core.plan([a], 10_600.0) == [Unload("m", "a", "idle for 600 s")]
    set_state(a, "m", "ready")
    core.ask("m", [a], 20_000.0)
    core.touch("m", 20_000.0, keep=0.0)  # 0: unloaded once idle, and not wanted again
    a.in_flight["m"] = 1
    assert core.plan([a], 20_000.0) == []  # the request is still running
    a.in_flight["m"] = 0
    assert core.plan([a], 20_000.5) == [Unload("m", "a", "idle for 0 s")]
    assert core.desired("m", 20_001.0) == 0
    core.touch("m", 30_000.0)  # a request without keep_alive: the catalog's 60 s again
    assert core.plan([a], 30_059.0) == []


def test_a_deleted_model_leaves_the_catalog_once_no_node_lists_it():
    core = Models(cfg([{"Name": "kept"}]))
    a = node("a", models=["kept", "gone"])
    core.ask("gone", [a], 0.0)
    assert core.names([a]) == ["gone", "kept"]
    core.forget("gone")
    core.forget("kept")  # a configured model stays whatever an engine did
    assert core.names([a]) == ["gone", "kept"]  # the node still lists it
    b = node("a", models=["kept"])
    assert core.names([b]) == ["kept"] and "gone" not in core.health
    assert core.names([b]) == ["kept"]
    assert core.names([a]) == ["gone", "kept"]  # pulled again: known again
    assert core.deleted == {}


def test_always_on_replicas_placed_one_per_node():
    core = Models(cfg([{"Name": "m", "Replicas": 2}]))
    a, b = node("a", models=["m"]), node("b", models=["m"])
    acts = core.plan([a, b], 0.0)
    assert sorted(x.node for x in acts) == ["a", "b"]
    assert core.plan([a, b], 0.0) == []  # pending loads count
    core2 = Models(cfg([{"Name": "m", "Replicas": 2}]))
    assert len(core2.plan([a], 0.0)) == 1
    assert "every node that can hold it has one" in core2.health["m"].unplaceable


def test_a_success_settles_until_the_node_shows_it():
    core = Models(cfg([{"Name": "m"}]))
    a, b = node("a", models=["m"]), node("b", models=["m"])
    core.ask("m", [a, b], 0.0)
    core.load_done("m", core.pending[0].node, None, 0.0)
    first = core.pending[0].node
    assert core.ask("m", [a, b], 1.0)[1] == []  # not placed twice while the state catches up
    set_state({"a": a, "b": b}[first], "m", "ready")
    assert core.plan([a, b], 2.0) == [] and core.pending == []
    # A load the node answered but never showed ready stops counting after a while.
    set_state({"a": a, "b": b}[first], "m", "available")
    core.ask("m", [a, b], 3.0)
    core.load_done("m", core.pending[0].node, None, 3.0)
    assert core.plan([a, b], 12.9) == []
    assert len(core.plan([a, b], 13.0)) == 1


@pytest.mark.parametrize("lost", [True])
def test_a_lost_node_is_not_the_models_fault(lost):
    core = Models(cfg([{"Name": "m"}]))
    a = node("a", models=["m"])
    core.ask("m", [a], 0.0)
    core.load_lost("m", "a", "ConnectError", 0.0)
    assert core.health["m"].failures == 0 and core.pending == []
    assert core.health["m"].next_attempt == 1.0
