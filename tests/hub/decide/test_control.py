"""The control plane's trio shell against fake node calls, in virtual time (no sockets)."""

from __future__ import annotations

import re

import pytest
import trio
from prometheus_client import CollectorRegistry, generate_latest

from appliance.http.errors import ApiError
from appliance.hub.decide.control import Control
from appliance.hub.fleet.nodes import Registry
from appliance.hub.fleet.ops import NodeRefused
from appliance.hub.observe.fleet_metrics import ControlCollector
from appliance.wire import EngineInstall, ModelState, NodeState
from tests.hub.decide.test_placement import cfg, set_state

KEV_ERROR = "unknown model architecture: 'kev'"


class FakeOps:
    """Plays the node's control API: a load takes `load_seconds`, then is ready or fails."""

    def __init__(self, registry: Registry, load_seconds: float = 1.0) -> None:
        self.registry = registry
        self.load_seconds = load_seconds
        self.fail: dict[str, str] = {}
        self.loads: list[tuple[str, str, float]] = []
        self.unloads: list[tuple[str, str]] = []
        self.controls: list[tuple[str, str]] = []
        self.asserted: list[str] = []
        self.forged: dict[str, int] = {}
        self.unload_seconds = 0.0

    async def load(self, h, model, req, read_seconds):
        self.loads.append((h.name, model, trio.current_time()))
        set_state(h, model, "loading")
        self.registry.changed()
        await trio.sleep(self.load_seconds)
        err = self.fail.get(model)
        set_state(h, model, "failed" if err else "ready")
        self.registry.changed()
        if err:
            raise NodeRefused(500, err)

    async def unload(self, h, model):
        self.unloads.append((h.name, model))
        await trio.sleep(self.unload_seconds)
        set_state(h, model, "available")
        self.registry.changed()

    async def assert_epoch(self, h):
        """The leader's epoch asserted to `h`; `forged[name]`: an epoch the node keeps
        instead (it refuses ours)."""
        self.asserted.append(h.name)
        forged = self.forged.get(h.name, 0)
        h.epoch = max(forged, getattr(self, "epoch", None) or 0)
        h.fenced = f"epoch {self.epoch} is older than {forged}" if forged else ""

    async def control(self, h, action):
        self.controls.append((h.name, action))
        h.state.paused = action == "pause"
        self.registry.changed()


class FakeAudit:
    failing = False  # what admin.status reads of the real AuditLog

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]


def add_node(registry: Registry, name: str, total: int, models: dict[str, int]) -> None:
    h, _ = registry.upsert(name, f"http://{name}:9090", static=False)
    state = NodeState(name=name, engines=[EngineInstall("sim", "0.1")], memory_total_mb=total,
                      memory_used_mb=0,
                      models=[ModelState(m, s) for m, s in models.items()])
    registry.apply_state(h, state)


def make(models: list[dict], nodes: dict[str, tuple[int, dict[str, int]]], beat=lambda: None,
         **extra):
    registry = Registry()
    for name, (total, ms) in nodes.items():
        add_node(registry, name, total, ms)
    ops, audit, metrics = FakeOps(registry), FakeAudit(), CollectorRegistry()
    control = Control(cfg(models, **extra), registry, None, audit, ops=ops, beat=beat)
    metrics.register(ControlCollector(control))
    return control, registry, ops, audit, metrics


async def error_of(coro) -> ApiError:
    with pytest.raises(ApiError) as info:
        await coro
    return info.value


async def test_parks_after_five_failed_starts_then_answers_at_once(nursery, autojump_clock):
    control, registry, ops, audit, _ = make([{"Name": "kev-0.5b"}], {"a": (8000,
                                                                           {"kev-0.5b": 500})})
    ops.fail["kev-0.5b"] = KEV_ERROR
    ops.load_seconds = 0.99  # off the 250 ms poll grid
    await nursery.start(control.run)
    start = trio.current_time()
    err = await error_of(control.activate("kev-0.5b"))
    # Five starts, backoff 1, 2, 4, 8 s after each failure; parked mid-wait, seen at the next poll.
    assert [t - start for _, _, t in ops.loads] == pytest.approx([0, 1.99, 4.98, 9.97, 18.96])
    assert trio.current_time() == start + 20
    assert err.status == 503 and err.code == "model_parked" and KEV_ERROR in err.message and err.retry_after is None
    assert len(ops.loads) == 5
    assert audit.kinds().count(
        "model_start_failed") == 4 and audit.kinds().count("model_parked") == 1
    # The next request: 503 at once naming the error, and nothing is started.
    now = trio.current_time()
    assert (await error_of(control.make_servable("kev-0.5b"))).code == "model_parked"
    assert (await error_of(control.activate("kev-0.5b"))).code == "model_parked"
    await trio.sleep(600)
    assert trio.current_time() == now + 600 and len(ops.loads) == 5
    assert control.models_status()[0]["desired"] == 0  # nobody asked for ten minutes
    # a refused request still wants it
    assert (await error_of(control.make_servable("kev-0.5b"))).code == "model_parked"
    [st] = control.models_status()
    assert st["parked"] and st["last_error"] == KEV_ERROR and st["consecutive_start_failures"] == 5
    assert st["desired"] == 1 and st["ready"] == 0


async def test_retry_unparks_and_it_is_tried_again(nursery, autojump_clock):
    control, registry, ops, audit, _ = make([{"Name": "kev"}], {"a": (8000, {"kev": 500})},
                                            Models__ParkAfterFailures=2)
    ops.fail["kev"] = KEV_ERROR
    await nursery.start(control.run)
    assert (await error_of(control.activate("kev"))).code == "model_parked"
    assert len(ops.loads) == 2
    del ops.fail["kev"]
    assert control.retry("kev") and not control.retry("no-such-model")
    await trio.sleep(2)
    assert len(ops.loads) == 3 and registry.ready_nodes("kev")
    [st] = control.models_status()
    assert not st["parked"] and st["consecutive_start_failures"] == 0 and st["last_error"] == ""
    assert "model_retry" in audit.kinds()


async def test_definition_change_by_reload_unparks(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "kev", "Source": "/m/kev.bin"}],
                                        {"a": (8000, {"kev": 500})},
                                        Models__ParkAfterFailures=2)
    ops.fail["kev"] = KEV_ERROR
    await nursery.start(control.run)
    assert (await error_of(control.activate("kev"))).code == "model_parked"
    control.reload(cfg([{"Name": "kev", "Source": "/m/kev.bin"}], Models__ParkAfterFailures=2))
    # same definition: still parked
    assert (await error_of(control.make_servable("kev"))).code == "model_parked"
    ops.fail["kev"] = ""  # the new file loads
    control.reload(cfg([{"Name": "kev", "Source": "/m/kev-fixed.bin"}],
                       Models__ParkAfterFailures=2))
    await control.make_servable("kev")  # asks once, waits for that decision
    assert len(ops.loads) == 3


async def test_a_success_resets_the_count(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500})})
    ops.fail["m"] = "flaky"
    await nursery.start(control.run)
    with trio.move_on_after(2.5):  # first start fails at 1 s, second starts at 2 s
        await control.activate("m")
    assert control.models_status()[0]["consecutive_start_failures"] == 1
    ops.fail["m"] = ""
    await control.activate("m")
    assert control.models_status()[0]["consecutive_start_failures"] == 0


async def test_unplaceable_is_answered_at_once_then_a_bigger_node_places_it(nursery,
                                                                            autojump_clock):
    control, registry, ops, audit, _ = make([{"Name": "phi-4", "MemoryMb": 9800}],
                                            {"gpu-a": (8000, {"phi-4": 100}),
                                             "gpu-b": (4000, {"phi-4": 100})})
    await nursery.start(control.run)
    start = trio.current_time()
    err = await error_of(control.activate("phi-4"))
    assert trio.current_time() == start
    assert err.code == "model_unplaceable" and err.retry_after is None
    assert "needs 9800 MiB; the most free is 8000 MiB on gpu-a" in err.message
    assert (await error_of(control.make_servable("phi-4"))).code == "model_unplaceable"
    st = control.models_status()[0]
    assert st["unplaceable"] and st["desired"] == 1 and st["reason"].startswith("needs 9800 MiB")
    add_node(registry, "gpu-c", 16000, {"phi-4": 100})
    ops.load_seconds = 0.9  # ready between two polls
    # The stored result is stale; a request decides afresh and is not refused.
    await control.make_servable("phi-4")  # decides afresh, waits for that decision
    assert trio.current_time() == start + 1 and [n.name
                                                 for n in registry.ready_nodes(
                                                     "phi-4")] == ["gpu-c"]
    assert not control.models_status()[0]["unplaceable"]


async def test_room_made_when_busy_replica_finishes(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "big", "MemoryMb": 6000}, {"Name": "small",
                                                                             "MemoryMb": 4000}],
                                        {"a": (8000, {"big": 6000, "small": 4000})})
    await nursery.start(control.run)
    await control.activate("small")
    a = registry.nodes["a"]
    registry.start(a, "small")  # work in flight: never unloaded to make room
    err = await error_of(control.activate("big"))
    assert err.code == "model_unplaceable" and "needs 6000 MiB; the most free is 4000 MiB on a" in err.message
    registry.finish(a, "small")
    await control.make_servable("big")  # decides afresh, waits for that decision
    assert ops.unloads == [("a", "small")] and registry.ready_nodes("big")


async def test_loading_times_out_with_retry_after(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "slow"}], {"a": (8000, {"slow": 500})},
                                        Router__ActivationWaitSeconds=10)
    ops.load_seconds = 60
    await nursery.start(control.run)
    start = trio.current_time()
    err = await error_of(control.activate("slow"))
    assert trio.current_time() == start + 10
    assert err.code == "model_loading" and err.retry_after and "retry shortly" in err.message
    assert control.models_status()[0]["loading"] == 1


async def test_idle_on_demand_replica_is_unloaded(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "m", "IdleUnloadSeconds": 60}],
                                        {"a": (8000, {"m": 500})})
    await nursery.start(control.run)
    await control.activate("m")
    await trio.sleep(30)
    control.touch("m")
    await trio.sleep(59)
    assert ops.unloads == []
    await trio.sleep(2)
    assert ops.unloads == [("a", "m")] and control.models_status()[0]["desired"] == 0


async def test_always_on_replicas_are_kept_placed(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "m", "Replicas": 2}], {"a": (8000, {"m": 500}),
                                                                         "b": (8000, {"m": 500})})
    await nursery.start(control.run)
    await trio.sleep(2)
    assert sorted(n.name for n in registry.ready_nodes("m")) == ["a", "b"]
    await trio.sleep(3600)
    assert ops.unloads == [] and len(ops.loads) == 2


def _sample(text: str, name: str, **labels) -> float | None:
    lab = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    m = re.search(rf"^{name}{{{re.escape(lab)}}} (\S+)$" if labels else rf"^{name} (\S+)$", text,
                  re.M)
    return float(m.group(1)) if m else None


async def test_metrics_ready_zero_for_a_desired_model(nursery, autojump_clock, tmp_path):
    from tests.server.test_tlsinfo import CERT, NOT_AFTER

    cert = tmp_path / "hub.pem"
    cert.write_text(CERT)
    control, registry, ops, _, metrics = make(
        [{"Name": "always", "Replicas": 1}, {"Name": "phi-4", "MemoryMb": 99999}, {"Name": "idle"}],
        {"a": (8000, {"phi-4": 100})}, Hub__TlsCert=str(cert))
    await nursery.start(control.run)
    with pytest.raises(ApiError):
        await control.activate("phi-4")
    text = generate_latest(metrics).decode()
    # "always" is on no node: it should run and nothing is ready -- the series is there at 0.
    assert _sample(text, "appliance_model_desired", model="always") == 1
    assert _sample(text, "appliance_model_ready", model="always") == 0
    assert _sample(text, "appliance_model_unplaceable", model="always") == 1
    # An on-demand model asked for counts as desired.
    assert _sample(text, "appliance_model_desired", model="phi-4") == 1
    assert _sample(text, "appliance_model_ready", model="phi-4") == 0
    assert _sample(text, "appliance_model_unplaceable", model="phi-4") == 1
    assert _sample(text, "appliance_model_desired", model="idle") == 0
    assert _sample(text, "appliance_model_parked", model="idle") == 0
    assert _sample(text, "appliance_model_consecutive_start_failures", model="idle") == 0
    assert _sample(text, "appliance_node_engine_info", node="a", kind="sim", version="0.1") == 1
    import socket

    assert _sample(text, "appliance_leader", hub=socket.gethostname()) == 1  # alone, it leads
    assert _sample(text, "appliance_leader_changes_total") == 0
    assert _sample(text, "appliance_cluster_up") == 1
    assert _sample(text, "appliance_tls_cert_expiry_seconds", path=str(cert)) == NOT_AFTER
    cert.unlink()  # read from disk at each scrape: gone from disk, gone from the scrape
    assert "appliance_tls_cert_expiry_seconds{" not in generate_latest(metrics).decode()


async def test_models_status_keys_are_the_contract(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500,
                                                                       "discovered": 100})})
    await nursery.start(control.run)
    assert control.known("m") and control.known("discovered") and not control.known("nope")
    sts = control.models_status()
    assert [s["name"] for s in sts] == ["discovered", "m"]
    for s in sts:
        assert set(s) == {"name", "desired", "ready", "loading", "parked", "unplaceable", "reason",
                          "last_error",
                          "consecutive_start_failures", "nodes"}
    await control.activate("discovered")
    assert control.models_status()[0]["nodes"] == ["a"]


async def test_the_loop_warns_twice_for_1000_failed_placements_in_ten_minutes(nursery,
                                                                              autojump_clock,
                                                                              caplog):
    control, registry, ops, audit, _ = make([{"Name": "phi-4", "MemoryMb": 9800, "Replicas": 1}],
                                            {"gpu-a": (8000, {"phi-4": 100})},
                                            Hub__ControlIntervalSeconds=0.6)
    attempts = []
    place = control.core.place
    control.core.place = lambda *a: (attempts.append(trio.current_time()), place(*a))[1]
    caplog.set_level("WARNING", logger="appliance.hub.decide.placement")
    start = trio.current_time()
    await nursery.start(control.run)
    await trio.sleep(600.5)
    assert 1000 <= len(attempts) <= 1002 and attempts[-1] - start <= 600.5
    warned = [r for r in caplog.records if "no placement" in r.getMessage()]
    assert len(warned) == 2
    assert audit.kinds().count("model_unplaceable") == 2


async def test_every_turn_of_the_loop_beats_for_the_watchdog(nursery, autojump_clock):
    """systemd's watchdog is fed from the control loop: it turns at least every
    Hub__ControlIntervalSeconds (1 s) even with nothing to do."""
    beats: list[float] = []
    control, _, _, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500})},
                               beat=lambda: beats.append(trio.current_time()))
    start = trio.current_time()
    await nursery.start(control.run)
    await trio.sleep(10.5)
    assert len(beats) >= 11
    assert max(b - a for a, b in zip(beats, beats[1:], strict=False)) <= 1.0
    assert beats[0] == start


async def test_a_request_right_after_keep_alive_0_waits_for_the_reload(nursery, autojump_clock):
    """keep_alive 0 then the next request (issue 20): the replica being unloaded is not
    routed to, and its reload waits for the unload -- never a 503 "not loaded"."""
    control, registry, ops, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500})})
    ops.unload_seconds = 2.0
    await nursery.start(control.run)
    await control.make_servable("m")
    [h] = registry.nodes.values()
    assert h.ready("m") and len(ops.loads) == 1
    control.touch("m", 0)  # the first request's keep_alive 0, at its end
    await trio.sleep(0.5)  # the unload is in flight: the node still says ready
    assert ops.unloads == [("a", "m")] and h.state.model("m").state == "ready"
    assert not h.ready("m") and registry.ready_nodes("m") == []
    start = trio.current_time()
    await control.make_servable("m")  # the second request: reloaded, then served
    assert [(n, m) for n, m, _ in ops.loads] == [("a", "m"), ("a", "m")]
    assert ops.loads[1][2] >= start + 1.5  # the load went out once the unload was done
    assert h.ready("m") and h.unloading == set()


async def test_a_refused_unload_leaves_the_replica_routable(nursery, autojump_clock):
    control, registry, ops, _, _ = make([{"Name": "m"}], {"a": (8000, {"m": 500})})
    await nursery.start(control.run)
    await control.make_servable("m")

    async def refuse(h, model):
        raise NodeRefused(503, "busy")

    ops.unload = refuse
    control.touch("m", 0)
    await trio.sleep(0.5)
    [h] = registry.nodes.values()
    assert h.ready("m") and h.unloading == set()
