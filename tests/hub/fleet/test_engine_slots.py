"""Places that come from the engine (issue 27): a model's slots as its engine says them,
`Models__N__Slots` over them, `Node__ModelSlots` as the fallback; the engine's busy slots
counted in the cost, so load from outside the hub is seen."""

from __future__ import annotations

from appliance import config
from appliance.hub.decide.admission import Admission
from appliance.hub.decide.affinity import Route
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.wire import ModelState, NodeState
from tests.harness.admission_fleet import MODEL


def node(name: str, engine_slots: int | None, busy: int | None = None,
         node_slots: int | None = 1) -> NodeHandle:
    h = NodeHandle(name, f"http://{name}.test:9090", static=True)
    h.connected = True
    h.state = NodeState(name=name, slots=node_slots, models=[
        ModelState(name=MODEL, state="ready", slots=engine_slots, busy=busy)])
    return h


def test_the_engines_slots_win_over_node_model_slots():
    assert node("a", 4).places_left(MODEL) == 4
    assert node("a", None).places_left(MODEL) == 1  # the engine says nothing: Node__ModelSlots
    assert node("a", None, node_slots=None).places_left(MODEL) is None


def test_models_n_slots_overrides_the_engine_and_applies_to_known_states():
    r = Registry()
    a = node("a", 4)
    r.nodes["a"] = a
    adm = Admission(config.load({"Models__0__Name": MODEL, "Models__0__Slots": "2"}), r)
    assert a.places_left(MODEL) == 2  # a state already known
    b = node("b", 8)
    r.nodes["b"] = b
    r.apply_state(b, b.state)
    assert b.places_left(MODEL) == 2  # a state that arrives later
    adm.reload(config.load({"Models__0__Name": MODEL, "Models__0__Slots": "3"}))
    assert a.places_left(MODEL) == b.places_left(MODEL) == 3


def test_busy_slots_from_outside_the_hub_are_counted_in_the_cost():
    """Two nodes, the session's prompt on both (the same prefix); a's engine says both its
    slots are busy (requests the hub did not send): the request goes to b."""
    r = Registry()
    a, b = node("a", 2, busy=2), node("b", 2, busy=0)
    r.nodes.update(a=a, b=b)
    adm = Admission(config.load({}), r)
    s = b"outside-load-s!!"
    for n in ("a", "b"):
        adm.cost.rates.observe(n, MODEL, service_s=0.5, first_s=1.0, uncached=1000)
    adm.cost.learn(MODEL, Route(session=s, prompt_tokens=2000, cached_tokens=0), "a",
                   service_s=None, first_s=None)
    # a holds the session, but its engine is full: b has a place (and a cold prefill)
    node_, wait = adm.pick(MODEL, Route(session=s, size=8000), [])
    assert node_ is a and wait > 0  # waits for its home: the saving (2 s) beats 0.5 s
    a.state.models[0].busy = 2
    adm.cost.rates.by[("a", MODEL)].service = 5.0  # a long line there now
    node_, wait = adm.pick(MODEL, Route(session=s, size=8000), [])
    assert node_ is b and wait == 0


def test_an_engine_that_says_busy_but_not_its_slots_counts_against_node_model_slots():
    """vLLM without max_num_seqs in /metrics: its running + waiting against
    Node__ModelSlots; 5 held on 4 places is one beyond them (its own queue)."""
    from appliance.hub.decide.cost import free_of

    assert free_of(node("a", None, busy=5, node_slots=4), MODEL) == -1
    assert free_of(node("a", None, busy=1, node_slots=4), MODEL) == 3
    assert free_of(node("a", None, busy=None, node_slots=4), MODEL) == 4
