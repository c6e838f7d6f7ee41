"""The admission decision core (appliance/hub/decide/priority.py), called directly: no trio, no sockets."""

from __future__ import annotations

import os

import pytest

from appliance import cli, config
from appliance.http.errors import ApiError
from appliance.hub.decide.priority import (
    CLASSES,
    QUEUE_RETRY_AFTER,
    AdmissionCore,
    Fleet,
    count,
    effective_class,
    fleet_of,
    ready_nodes,
)
from appliance.hub.decide.slots import SlotQueues
from tests.harness.admission_fleet import MODEL, handle, registry


def core(enabled=True, reserve=1, max_depth=64, max_wait=30.0,
         background_max_wait=600.0) -> AdmissionCore:
    return AdmissionCore(enabled=enabled, reserve=reserve, max_depth=max_depth, max_wait=max_wait,
                         background_max_wait=background_max_wait)


# --- the header table ----------------------------------------------------------------------

HEADER_VALUES = [None, "essential", "normal", "background", "Background", " background ",
                 "BACKGROUND",
                 "low", "", "high"]


def _expected(client_cls: str, value: str | None) -> str:
    order = list(CLASSES)
    asked = (value or "").strip().lower()
    if asked in order and order.index(asked) > order.index(client_cls):
        return asked
    return client_cls


@pytest.mark.parametrize("header", [b"x-priority", b"x-inferhub-priority"])
@pytest.mark.parametrize("value", HEADER_VALUES)
@pytest.mark.parametrize("client_cls", CLASSES)
def test_header_table(client_cls, value, header):
    headers = [(b"content-type", b"application/json")]
    if value is not None:
        headers.append((header, value.encode()))
    assert effective_class(True, client_cls, headers) == _expected(client_cls, value)
    # Priority off: every request is normal, whatever it asks.
    assert effective_class(False, client_cls, headers) == "normal"


def test_header_lowest_of_both_wins_and_higher_is_ignored():
    both = [(b"x-priority", b"normal"), (b"x-inferhub-priority", b"background")]
    assert effective_class(True, "essential", both) == "background"
    assert effective_class(True, "background", [(b"x-priority", b"essential")]) == "background"
    assert effective_class(True, None, []) == "normal"  # the anonymous client


# --- free places ---------------------------------------------------------------------------

def test_fleet_counts_only_routable_nodes_with_the_model_ready():
    a = handle("a", slots=2)
    paused = handle("p", slots=5, paused=True)
    over = handle("o", slots=5, over_limits=True)
    cordoned = handle("c", slots=5)
    cordoned.cordoned = True
    lost = handle("l", slots=5)
    lost.connected = False
    loading = handle("x", slots=5, model_state="loading")
    other = handle("y", slots=5, models=("other",))
    r = registry(a, paused, over, cordoned, lost, loading, other)
    assert fleet_of(r.nodes.values(), MODEL) == Fleet(places=2, room=None)
    assert count(ready_nodes(r.nodes.values(), MODEL), MODEL).places == 2


def test_fleet_places_are_the_lesser_of_concurrency_and_slots():
    a = handle("a", slots=2, max_concurrency=3)
    b = handle("b", slots=4, max_concurrency=1)
    r = registry(a, b)
    assert fleet_of(r.nodes.values(), MODEL) == Fleet(places=3, room=4)
    r.start(a, MODEL)
    r.start(a, "other")
    assert fleet_of(r.nodes.values(), MODEL) == Fleet(places=2, room=2)


def test_unbounded_node_holds_nothing():
    r = registry(handle("a", slots=1), handle("free", slots=None, max_concurrency=None))
    fleet = fleet_of(r.nodes.values(), MODEL)
    assert fleet == Fleet(places=None, room=None)
    c = core(reserve=5)
    assert c.arrive(MODEL, "background", "batch", fleet) is None


# --- the reserve ---------------------------------------------------------------------------

def test_reserve_held_and_released():
    c = core(reserve=1)
    assert c.arrive(MODEL, "background", "batch", Fleet(places=2, room=None)) is None
    w = c.arrive(MODEL, "background", "batch", Fleet(places=1, room=None))
    assert w is not None and c.classes["background"].waiting == 1
    assert c.dispatch(MODEL, Fleet(places=1, room=None)) == []
    assert c.dispatch(MODEL, Fleet(places=2, room=None)) == [w]
    c.started(w)
    s = c.classes["background"].as_dict()
    assert s == {"waiting": 0, "held": 1, "released": 1, "timed_out": 0, "requests": 2}
    assert c.queues == {}


def test_reserve_zero_lets_background_take_the_last_place():
    c = core(reserve=0)
    assert c.arrive(MODEL, "background", "batch", Fleet(places=1, room=None)) is None
    assert c.arrive(MODEL, "background", "batch", Fleet(places=0, room=None)) is not None


def test_node_removed_makes_background_wait_while_essential_and_normal_run():
    a, b = handle("a"), handle("b")
    r = registry(a, b)
    c = core(reserve=1)
    fleet = lambda: fleet_of(r.nodes.values(), MODEL)  # noqa: E731
    assert c.arrive(MODEL, "background", "batch", fleet()) is None  # two places free
    r.mark_lost(b, "test")
    assert fleet() == Fleet(places=1, room=None)
    assert c.arrive(MODEL, "background", "batch", fleet()) is not None
    assert c.arrive(MODEL, "essential", "ops", fleet()) is None
    r.start(a, MODEL)
    assert c.arrive(MODEL, "normal", "team", fleet()) is None  # slots full, no cap: it still goes


def test_priority_off_every_request_is_normal_and_nothing_is_held():
    c = core(enabled=False, reserve=5)
    assert c.arrive(MODEL, "background", "batch", Fleet(places=0, room=None)) is None
    assert c.classes["normal"].requests == 1 and c.classes["background"].requests == 0


# --- the capacity queue --------------------------------------------------------------------

FULL = Fleet(places=0, room=0)


def test_class_order_in_the_capacity_wait():
    c = core(reserve=0)
    n1 = c.arrive(MODEL, "normal", "team", FULL)
    b1 = c.arrive(MODEL, "background", "batch", FULL)
    e1 = c.arrive(MODEL, "essential", "ops", FULL)
    n2 = c.arrive(MODEL, "normal", "team2", FULL)
    e2 = c.arrive(MODEL, "essential", "ops2", FULL)
    assert c.dispatch(MODEL, Fleet(places=1, room=1)) == [e1]
    c.started(e1)
    assert c.dispatch(MODEL, Fleet(places=3, room=3)) == [e2, n1, n2]
    for w in (e2, n1, n2):
        c.started(w)
    assert c.dispatch(MODEL, Fleet(places=1, room=1)) == [b1]


def test_grants_count_until_started_so_one_place_is_not_given_twice():
    c = core()
    w1 = c.arrive(MODEL, "normal", "a", FULL)
    w2 = c.arrive(MODEL, "normal", "b", FULL)
    assert c.dispatch(MODEL, Fleet(places=1, room=1)) == [w1]
    # The same place, seen again before w1's task ran: nobody else gets it.
    assert c.dispatch(MODEL, Fleet(places=1, room=1)) == []
    assert c.arrive(MODEL, "essential", "ops", Fleet(places=1, room=1)) is not None
    # w1 hung up before it woke: its place goes to the next in class order.
    assert c.leave(w1, timed_out=False) is True
    woken = c.dispatch(MODEL, Fleet(places=1, room=1))
    assert len(woken) == 1 and woken[0].cls == "essential"
    assert w2.granted is False


def test_a_new_arrival_never_passes_a_waiter_of_its_class_or_higher():
    c = core(reserve=1)
    held = c.arrive(MODEL, "background", "batch", Fleet(places=1, room=None))
    # Places came back but no change was seen yet: the next background queues behind.
    assert c.arrive(MODEL, "background", "batch2", Fleet(places=5, room=None)) is not None
    # A higher class is not behind it.
    assert c.arrive(MODEL, "normal", "team", Fleet(places=1, room=None)) is None
    assert [w.client for w in c.dispatch(MODEL, Fleet(places=5, room=None))] == ["batch", "batch2"]
    assert held.granted


def test_queue_full_at_max_depth_and_lower_classes_never_push_out_higher():
    c = core(reserve=0, max_depth=2)
    c.arrive(MODEL, "background", "b1", FULL)
    c.arrive(MODEL, "background", "b2", FULL)
    with pytest.raises(ApiError) as e:
        c.arrive(MODEL, "background", "b3", FULL)
    assert (e.value.status, e.value.code, e.value.retry_after) == (503, "queue_full",
                                                                   QUEUE_RETRY_AFTER)
    assert c.arrive(MODEL, "normal", "n1", FULL) is not None
    assert c.arrive(MODEL, "essential", "e1", FULL) is not None
    with pytest.raises(ApiError):
        c.arrive(MODEL, "normal", "n2", FULL)  # n1 and e1 wait at its class or higher
    assert c.arrive(MODEL, "essential", "e2", FULL) is not None
    assert c.models[MODEL].full == 2 and c.models[MODEL].waiting == 5


def test_max_depth_zero_refuses_every_wait():
    c = core(max_depth=0)
    with pytest.raises(ApiError):
        c.arrive(MODEL, "essential", "ops", FULL)
    assert c.arrive(MODEL, "essential", "ops", Fleet(places=0, room=1)) is None


def test_timeouts_and_their_errors():
    c = core(reserve=1, max_wait=30, background_max_wait=600)
    b = c.arrive(MODEL, "background", "batch", Fleet(places=1, room=None))
    n = c.arrive(MODEL, "normal", "team", FULL)
    assert c.wait_limit(b) == 600 and c.wait_limit(n) == 30
    assert c.leave(b, timed_out=True) is False
    err = c.timeout_error(b)
    assert (err.status, err.code, err.retry_after) == (503, "priority_wait_timeout", None)
    assert "'batch'" in err.message
    c.leave(n, timed_out=True)
    err = c.timeout_error(n)
    assert (err.status, err.code, err.retry_after) == (503, "queue_timeout", QUEUE_RETRY_AFTER)
    assert c.classes["background"].timed_out == 1 and c.classes["normal"].timed_out == 1
    assert c.models[MODEL].timeouts == 2 and c.models[MODEL].waiting == 0
    assert c.queues == {}
    # Leaving twice changes nothing.
    assert c.leave(n, timed_out=True) is False and c.models[MODEL].timeouts == 2


def test_priority_off_background_waits_like_normal_in_the_capacity_queue():
    c = core(enabled=False)
    w = c.arrive(MODEL, "background", "batch", FULL)
    assert w.cls == "normal" and c.wait_limit(w) == 30
    assert c.timeout_error(w).code == "queue_timeout"


# --- slot waits ----------------------------------------------------------------------------

def test_slot_wait_essential_goes_at_once():
    s = SlotQueues()
    assert s.enter("a", MODEL, "essential", in_flight=5, slots=1) is None
    assert s.enter("a", MODEL, "normal", in_flight=1, slots=1) is None  # its own slot
    assert s.enter("a", MODEL, "normal", in_flight=3, slots=None) is None  # no slots declared


def test_slot_wait_releases_in_order_as_slots_free():
    s = SlotQueues()
    # in_flight counts the request itself: 1 sent + this one.
    w1 = s.enter("a", MODEL, "normal", in_flight=2, slots=1)
    w2 = s.enter("a", MODEL, "background", in_flight=3, slots=1)
    w3 = s.enter("a", MODEL, "normal", in_flight=4, slots=1)
    assert None not in (w1, w2, w3)
    assert s.dispatch("a", MODEL, in_flight=4, slots=1, routable=True) == []
    assert s.dispatch("a", MODEL, in_flight=3, slots=1,
                      routable=True) == [w1]  # the sent one finished
    assert s.dispatch("a", MODEL, in_flight=3, slots=1, routable=True) == []
    s.leave("a", w3)  # ran out: sent anyway
    assert s.dispatch("a", MODEL, in_flight=1, slots=1, routable=True) == [w2]
    assert s.keys() == []


def test_slot_wait_ends_when_the_node_goes():
    s = SlotQueues()
    w = s.enter("a", MODEL, "normal", in_flight=2, slots=1)
    assert s.dispatch("a", MODEL, in_flight=2, slots=1, routable=False) == [w]


# --- the validators ------------------------------------------------------------------------

@pytest.mark.parametrize("env, var", [
    ({"Auth__Clients__0__Key": "k", "Auth__Clients__0__Priority": "esential"},
     "Auth__Clients__0__Priority"),
    ({"Priority__ReserveSlots": "-1"}, "Priority__ReserveSlots"),
    ({"Priority__BackgroundMaxWaitSeconds": "-5"}, "Priority__BackgroundMaxWaitSeconds"),
    ({"Queue__MaxWaitSeconds": "-1"}, "Queue__MaxWaitSeconds"),
    ({"Queue__SlotWaitSeconds": "-1"}, "Queue__SlotWaitSeconds"),
    ({"Priority__Enabled": "maybe"}, "Priority__Enabled"),
])
def test_validators_name_the_variable(env, var, monkeypatch, capsys):
    with pytest.raises(config.ConfigError) as e:
        config.load(env)
    assert var in str(e.value) and "\n" not in str(e.value)
    for k in list(os.environ):
        if "__" in k or k.startswith("APPLIANCE_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(["hub"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and var in err[0]


def test_misspelt_class_says_what_is_allowed():
    with pytest.raises(config.ConfigError) as e:
        config.load({"Auth__Clients__0__Key": "k", "Auth__Clients__0__Priority": "backround"})
    assert "essential, normal, background" in str(e.value) and '"background"' in str(e.value)


def test_defaults():
    cfg = config.load({})
    assert (cfg.priority.enabled, cfg.priority.reserve_slots,
            cfg.priority.background_max_wait_seconds) == (False, 1, 600)
    assert (cfg.queue.max_wait_seconds, cfg.queue.max_depth, cfg.queue.slot_wait_seconds) == (30,
                                                                                              64, 0)
    cfg = config.load({"Auth__Clients__0__Key": "k"})
    assert cfg.auth.clients[0].priority == "normal"
