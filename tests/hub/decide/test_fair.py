"""Fair queueing inside a class (hub/decide/fair.py, through priority.AdmissionCore)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.hub.decide.fair import FairLane, cost
from appliance.hub.decide.lanes import Waiter
from appliance.hub.decide.priority import AdmissionCore, Fleet

FULL = Fleet(places=0, room=0)
ONE = Fleet(places=1, room=1)


def core() -> AdmissionCore:
    return AdmissionCore(enabled=True, reserve=1, max_depth=1000, max_wait=30,
                         background_max_wait=60)


def grant_one(c: AdmissionCore) -> Waiter:
    [w] = c.dispatch("m", ONE)
    c.started(w)
    return w


def test_a_heavy_key_does_not_hold_back_a_light_one() -> None:
    c = core()
    heavy = [c.arrive("m", "normal", "batch", FULL, cost=100) for _ in range(20)]
    light = c.arrive("m", "normal", "chat", FULL, cost=100)
    assert grant_one(c) is heavy[0]
    assert grant_one(c) is light  # first come would have been 19 more of batch
    assert grant_one(c) is heavy[1]


def test_a_lone_key_is_first_in_first_out() -> None:
    c = core()
    ws = [c.arrive("m", "normal", "a", FULL, cost=10 * (i + 1)) for i in range(5)]
    assert [grant_one(c) for _ in ws] == ws


def test_weight_two_gets_twice_the_service() -> None:
    c = core()
    for _ in range(30):
        c.arrive("m", "normal", "gold", FULL, cost=10, weight=2.0)
        c.arrive("m", "normal", "tin", FULL, cost=10)
    got = [grant_one(c).client for _ in range(30)]
    assert got.count("gold") == 20 and got.count("tin") == 10


def test_a_returning_key_earns_no_credit_for_time_away() -> None:
    c = core()
    for _ in range(10):
        c.arrive("m", "normal", "a", FULL, cost=10)
    b = c.arrive("m", "normal", "b", FULL, cost=10)
    assert [grant_one(c).client for _ in range(4)] == ["a", "b", "a", "a"]
    assert b.fair is not None  # b was served and left the backlog
    lane = c.queues["m"].lanes[1]
    floor = lane.counters["a"]
    c.arrive("m", "normal", "b", FULL, cost=10)
    assert lane.counters["b"] == floor  # lifted to the backlog's minimum, no banked credit


def test_class_order_stays_above_fairness() -> None:
    c = core()
    n = c.arrive("m", "normal", "team", FULL, cost=1)
    e = c.arrive("m", "essential", "ops", FULL, cost=10**6)
    assert grant_one(c) is e and grant_one(c) is n


def test_settle_corrects_the_charge() -> None:
    lane = FairLane()
    w = Waiter("m", "normal", "a", cost=cost(10, 100))
    lane.add(w)
    lane.add(Waiter("m", "normal", "b", cost=cost(10, 100)))
    lane.pop()
    charged = lane.counters["a"]
    assert w.fair is not None
    lane.settle("a", w.fair[1], w.cost, cost(10, 5), 1.0)
    assert lane.counters["a"] == charged - 190


def test_an_empty_lane_starts_a_new_episode() -> None:
    lane = FairLane()
    w = Waiter("m", "normal", "a", cost=50)
    lane.add(w)
    lane.pop()
    lane.add(Waiter("m", "normal", "b", cost=50))
    assert lane.counters == {"b": 0.0}
    assert w.fair is not None
    lane.settle("a", w.fair[1], 50, 0, 1.0)  # from the old episode: dropped
    assert "a" not in lane.counters


# --- the property: the VTC bound between two backlogged keys ------------------------------

@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 1000)), min_size=1,
                max_size=200),
       st.lists(st.integers(0, 3), max_size=200))
def test_two_backlogged_keys_stay_within_the_vtc_bound(arrivals: list[tuple[str, int]],
                                                       grants: list[int]) -> None:
    """Keys a and b keep a backlog; c comes and goes. Over any stretch in which a and b
    both wait, the service each got differs by at most twice the largest charge."""
    c = core()
    biggest = 1000
    for _ in range(300):  # a and b stay backlogged throughout
        c.arrive("m", "normal", "a", FULL, cost=biggest)
        c.arrive("m", "normal", "b", FULL, cost=1)
    served = {"a": 0, "b": 0, "c": 0}
    gaps = []
    it = iter(arrivals)
    for n in grants + [1] * 50:
        for _ in range(n):
            nxt = next(it, None)
            if nxt is not None:
                key, k_cost = nxt
                c.arrive("m", "normal", key, FULL, cost=k_cost)
        w = grant_one(c)
        served[w.client] += w.cost
        gaps.append(served["a"] - served["b"])
    assert max(abs(g) for g in gaps) <= 2 * biggest
