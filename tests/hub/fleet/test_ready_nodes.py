"""Readiness is the registry's, made once per change of the fleet (issue 26): the ready
list a request reads is kept across heartbeats that change no readiness, and made afresh
when a node's ready models, its status, a cordon or an unload change it."""

from appliance.hub.decide.admission import Admission
from appliance.hub.decide.affinity import Route
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.wire import UNHEALTHY, ModelState, NodeState
from tests.hub.decide.test_placement import cfg


def _state(name: str, ready: tuple[str, ...] = ("m",), in_flight: int = 0,
           paused: bool = False, health: str = "") -> NodeState:
    return NodeState(name=name, paused=paused, in_flight=in_flight,
                     models=[ModelState(name=m, state="ready", health=health) for m in ready])


def _fleet(*names: str) -> tuple[Registry, list[NodeHandle]]:
    r = Registry()
    hs = []
    for n in names:
        h, _ = r.upsert(n, f"http://{n}:1", static=True)
        r.apply_state(h, _state(n))
        hs.append(h)
    return r, hs


def test_a_heartbeat_that_changes_no_readiness_keeps_the_ready_list():
    r, (a, b) = _fleet("a", "b")
    ready = r.ready_nodes("m")
    assert [h.name for h in ready] == ["a", "b"]
    r.apply_state(a, _state("a", in_flight=3))  # busier, as ready as before
    assert r.ready_nodes("m") is ready


def test_each_change_of_readiness_makes_the_list_afresh():
    r, (a, b) = _fleet("a", "b")
    r.ready_nodes("m")
    r.apply_state(a, _state("a", ready=()))  # the node unloaded it
    assert [h.name for h in r.ready_nodes("m")] == ["b"]
    r.apply_state(a, _state("a", health=UNHEALTHY))  # back, but its probes fail
    assert [h.name for h in r.ready_nodes("m")] == ["b"]
    r.apply_state(a, _state("a"))
    assert [h.name for h in r.ready_nodes("m")] == ["a", "b"]
    r.apply_state(b, _state("b", paused=True))  # its owner paused it
    assert [h.name for h in r.ready_nodes("m")] == ["a"]
    a.cordoned = True
    r.changed()  # what the admin API and the cluster view call after a cordon
    assert r.ready_nodes("m") == []
    a.cordoned = False
    r.changed()
    r.mark_lost(a, "gone")
    assert r.ready_nodes("m") == []


def test_an_unload_takes_the_node_out_of_the_ready_list_at_once():
    r, (a, b) = _fleet("a", "b")
    r.ready_nodes("m")
    r.unloading(a, "m")  # the control loop decided: no request goes there from now
    assert [h.name for h in r.ready_nodes("m")] == ["b"]
    r.unloading(a, "m", False)  # the unload was refused: routable as before
    assert [h.name for h in r.ready_nodes("m")] == ["a", "b"]
    r.unloading(b, "m")
    r.apply_state(b, _state("b", ready=()))  # the node shows the unload: its own word
    assert b.unloading == set() and [h.name for h in r.ready_nodes("m")] == ["a"]


def test_admission_picks_no_node_being_unloaded():
    r, (a, b) = _fleet("a", "b")
    adm = Admission(cfg([]), r)
    assert adm.pick("m", None, [])[0] is not None
    r.unloading(a, "m")
    for _ in range(4):  # by affinity's order too (its candidates are the ready list)
        assert adm.pick("m", Route(chain=[1, 2]), [])[0] is b
    r.unloading(b, "m")
    assert adm.pick("m", None, []) == (None, 0.0)
    assert adm.fleet("m").places == 0
