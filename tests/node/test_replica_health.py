"""Generation probes and replica health, decided without sockets (node/health.py), and how
the hub reads a node's word on it (routing, placement, parking, status, series)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from appliance import config
from appliance.hub.decide.placement import Models
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.observe.replica_metrics import ReplicaCollector
from appliance.node.health import ReplicaHealth
from appliance.wire import UNHEALTHY, EngineInstall, ModelState, NodeState


class Calls:
    def __init__(self) -> None:
        self.changes = 0
        self.unhealthy: list[str] = []

    def changed(self) -> None:
        self.changes += 1


def _health(every: float = 60.0, timeout: float = 30.0) -> tuple[ReplicaHealth, Calls]:
    c = Calls()
    return ReplicaHealth(every, timeout, c.changed, c.unhealthy.append), c


def test_an_idle_model_is_probed_after_the_interval_and_only_once_at_a_time():
    h, _ = _health()
    h.loaded(["m"], 100.0)
    assert h.due(159.0) == []
    assert h.due(160.0) == ["m"]
    assert h.due(500.0) == []  # its probe is still running
    h.probe_done("m", None, 161.0)
    assert h.due(220.0) == [] and h.due(221.0) == ["m"]
    assert h.next_check(161.0) == 161.0 + 30.0  # the timeout bounds the wait
    h.probe_done("m", None, 222.0)
    assert h.next_check(250.0) == 250.0 + 30.0 and h.next_check(270.0) == 282.0


def test_zero_seconds_means_no_probes():
    h, _ = _health(every=0)
    h.loaded(["m"], 0.0)
    assert h.due(10_000.0) == []


def test_a_model_serving_requests_is_not_probed():
    h, _ = _health()
    h.loaded(["m"], 0.0)
    w = h.request("m", True, 10.0, lambda: None)
    h.answered(w, 11.0)
    assert h.due(100.0) == []  # in flight: its own request says how it does
    h.ended(w, 100.0)
    assert h.due(159.0) == [] and h.due(160.0) == ["m"]  # idle from its last answer


def test_a_failed_probe_marks_it_unhealthy_cuts_waiters_and_a_good_one_restores_it():
    h, c = _health()
    h.loaded(["m", "other"], 0.0)
    cut: list[str] = []
    waiting = h.request("m", False, 59.0, lambda: cut.append("waiting"))
    done = h.request("m", True, 59.0, lambda: cut.append("answered"))
    h.answered(done, 59.5)
    h.ended(waiting, 59.9)  # (not idle while these run: the probe is forced below)
    waiting = h.request("m", False, 60.0, lambda: cut.append("waiting"))
    h.replicas["m"].probing = True
    h.probe_done("m", "no answer to a one-token generation in 30 s", 90.0)
    assert h.of("m") == (UNHEALTHY, "no answer to a one-token generation in 30 s", 1)
    assert h.of("other") == ("ok", "", 0)
    assert cut == ["waiting"] and waiting.was_cut and not done.was_cut
    assert c.unhealthy == ["m"]
    h.replicas["m"].probing = True
    h.probe_done("m", "still hung", 150.0)
    assert c.unhealthy == ["m"]  # told once, when it turns
    assert h.of("m") == (UNHEALTHY, "still hung", 2)
    h.replicas["m"].probing = True
    h.probe_done("m", None, 210.0)
    assert h.of("m") == ("ok", "", 2)  # the count stays: it is a counter


def test_a_streamed_request_without_a_first_byte_in_the_bound_marks_it_unhealthy():
    h, c = _health(timeout=30.0)
    h.loaded(["m"], 0.0)
    cut: list[int] = []
    slow = h.request("m", False, 10.0, lambda: cut.append(1))  # not streamed: may take long
    streamed = h.request("m", True, 20.0, lambda: cut.append(2))
    assert h.next_check(21.0) == 50.0
    h.check(49.9)
    assert h.unhealthy("m") == "" and cut == []
    h.check(50.0)
    assert "no first byte in 30 s" in h.unhealthy("m")
    assert sorted(cut) == [1, 2] and slow.was_cut and streamed.was_cut
    assert c.unhealthy == ["m"]


def test_a_stream_queued_behind_a_generating_one_is_not_late():
    h, _ = _health(timeout=30.0)
    h.loaded(["m"], 0.0)
    running = h.request("m", True, 0.0, lambda: None)
    queued = h.request("m", True, 1.0, lambda: None)
    for t in range(1, 100):
        h.answered(running, float(t))  # a chunk a second
        h.check(float(t))
    assert h.unhealthy("m") == "" and not queued.was_cut
    h.check(129.0)  # the running one went silent at 99 too: nothing generates
    assert h.unhealthy("m") and queued.was_cut


def test_an_answered_stream_is_never_late():
    h, _ = _health(timeout=30.0)
    h.loaded(["m"], 0.0)
    w = h.request("m", True, 0.0, lambda: None)
    h.answered(w, 1.0)
    h.check(1000.0)
    assert h.unhealthy("m") == ""


def test_a_model_that_leaves_ready_is_forgotten_and_comes_back_healthy():
    h, _ = _health()
    h.loaded(["m"], 0.0)
    h.replicas["m"].probing = True
    h.probe_done("m", "hung", 1.0)
    h.loaded([], 2.0)  # restarted, unloaded
    assert h.of("m") == ("ok", "", 1)
    h.loaded(["m"], 3.0)
    assert h.unhealthy("m") == "" and h.due(62.0) == [] and h.due(63.0) == ["m"]
    w = h.request("gone", True, 0.0, lambda: None)  # not ready here: nothing watched
    assert w.answered


def test_a_request_sent_before_the_shells_next_look_is_watched():
    """The proxy says a model serves (its engine found) before the prober's next `loaded`:
    a stream sent in that window and never answered still marks the replica unhealthy."""
    h, _ = _health()
    cut: list[bool] = []
    h.ready("m", 0.0)
    w = h.request("m", True, 0.0, lambda: cut.append(True))
    assert not w.answered
    h.check(h.timeout)
    assert h.unhealthy("m") and cut == [True] and w.was_cut


# --- the hub's side ---------------------------------------------------------------------


def _state(name: str, health: str = "ok", why: str = "", failures: int = 0) -> NodeState:
    return NodeState(name=name, engines=[EngineInstall("sim", "0")], engine="sim",
                     memory_total_mb=8000, memory_used_mb=1000,
                     models=[ModelState("m", 1000, "ready", health=health, health_error=why,
                                        probe_failures=failures)])


def test_the_hub_routes_around_an_unhealthy_replica_and_hears_each_turn():
    r = Registry()
    a = r.upsert("a", "http://a", True)[0]
    b = r.upsert("b", "http://b", True)[0]
    turns: list[tuple[str, str, str]] = []
    r.health_listeners.append(lambda h, m, why: turns.append((h.name, m, why)))
    r.apply_state(a, _state("a"))
    r.apply_state(b, _state("b"))
    assert {h.name for h in r.ready_nodes("m")} == {"a", "b"} and turns == []
    r.apply_state(a, _state("a", UNHEALTHY, "hung", 1))
    assert [h.name for h in r.ready_nodes("m")] == ["b"]
    assert all(r.pick("m").name == "b" for _ in range(4))
    assert a.unhealthy("m") == "hung" and turns == [("a", "m", "hung")]
    r.apply_state(a, _state("a", UNHEALTHY, "still hung", 2))
    assert turns == [("a", "m", "hung")]
    r.apply_state(a, _state("a", "ok", "", 2))
    assert turns[-1] == ("a", "m", "") and a.ready("m")


def test_an_unhealthy_replica_counts_toward_parking_and_gets_no_second_replica_there():
    env = {"Models__0__Name": "m", "Models__0__Replicas": "1", "Models__ParkAfterFailures": "2"}
    core = Models(config.load(env))
    a, b = NodeHandle("a", "http://a", True), NodeHandle("b", "http://b", True)
    for h in (a, b):
        h.connected = True
    a.state, b.state = _state("a", UNHEALTHY, "hung"), _state("b")
    b.state.models[0].state = "available"
    _, acts = core.ask("m", [a, b], 0.0)
    assert [x.node for x in acts] == ["b"]  # not a second one on a
    core.replica_failed("m", "a", "hung", 1.0)
    st = core.status("m", [a, b], 1.0)
    assert st["consecutive_start_failures"] == 1 and st["last_error"] == "hung"
    assert not st["parked"]
    core.replica_failed("m", "a", "hung again", 2.0)
    assert core.status("m", [a, b], 2.0)["parked"]


def test_replica_series():
    r = Registry()
    a = r.upsert("a", "http://a", True)[0]
    b = r.upsert("b", "http://b", True)[0]
    r.apply_state(a, _state("a", UNHEALTHY, "hung", 3))
    r.apply_state(b, _state("b"))
    reg = CollectorRegistry()
    reg.register(ReplicaCollector(r))
    text = generate_latest(reg).decode()
    assert 'appliance_replica_healthy{model="m",node="a"} 0.0' in text
    assert 'appliance_replica_healthy{model="m",node="b"} 1.0' in text
    assert 'appliance_probe_failures_total{model="m",node="a"} 3.0' in text
    assert 'node="b"' not in text.split("appliance_probe_failures_total")[-1]
