"""The cost of a request on a node (appliance/hub/decide/cost.py): plain arithmetic."""

from __future__ import annotations

import logging

import pytest

from appliance.hub.decide import cost
from appliance.hub.decide.affinity import PrefixIndex
from appliance.hub.decide.cost import Option, Rate, Rates, home_wait, score, wait_s


def opt(name: str, free: int | None, held: int = 0, places: int | None = 1,
        service: float = 1.0, prefill: float = 1000.0) -> Option:
    return Option(name, free, places, held, Rate(service, prefill))


def test_wait_counts_the_requests_ahead_over_the_places():
    assert wait_s(None, None, 5.0) == 0.0  # unbounded: nothing to count
    assert wait_s(1, 1, 5.0) == 0.0  # a place left
    assert wait_s(0, 1, 5.0) == 5.0  # next in line behind one running
    assert wait_s(-2, 1, 5.0) == 15.0  # two already sent past its place
    assert wait_s(0, 4, 4.0) == 1.0  # four places: four times as fast a line


def test_cost_orders_by_wait_plus_uncached_prefill():
    # 2000-token prompt at 1000 tok/s: 2 s cold. Home holds 1900 tokens but one runs there.
    ranked = score([opt("cold", 1), opt("home", 0, held=1900, service=0.5)], 2000)
    assert [o.name for o in ranked] == ["home", "cold"]
    assert ranked[0].wait == 0.5 and ranked[0].prefill == pytest.approx(0.1)
    # A long line at home: cold is cheaper.
    ranked = score([opt("cold", 1), opt("home", -4, held=1900, service=0.5)], 2000)
    assert [o.name for o in ranked] == ["cold", "home"]
    # Ties keep the given (rendezvous) order.
    assert [o.name for o in score([opt("x", 1), opt("y", 1)], 100)] == ["x", "y"]
    assert [o.name for o in score([opt("y", 1), opt("x", 1)], 100)] == ["y", "x"]


def test_home_wait_when_the_saving_pays_bounded():
    ranked = score([opt("cold", 1), opt("home", 0, held=1900, service=0.5)], 2000)
    # saving: 2.0 - 0.1 = 1.9 s of prefill, beats the 0.5 s wait: wait at most the saving
    assert home_wait(ranked, 10.0) == pytest.approx(1.9)
    assert home_wait(ranked, 1.0) == 1.0  # Router__HomeWaitSeconds bounds it
    assert home_wait(ranked, 0.0) == 0.0  # 0: never waits


def test_no_home_wait_when_it_does_not_pay_or_nothing_is_free():
    # The cheapest has a place: no wait.
    assert home_wait(score([opt("home", 1, held=1900), opt("b", 1)], 2000), 10) == 0.0
    # The home's line is longer than the saving: the cold node wins, no wait.
    assert home_wait(score([opt("b", 1), opt("home", -9, held=1900)], 2000), 10) == 0.0
    # Every node full: the engine's own queue at home is the same wait, the hub holds none.
    assert home_wait(score([opt("b", 0), opt("home", 0, held=1900)], 2000), 10) == 0.0


def test_rates_learn_and_bound_nonsense_logged_once(caplog):
    r = Rates()
    assert r.get("a", "m").service == cost.DEFAULT_SERVICE_S
    r.observe("a", "m", service_s=1.0, first_s=0.5, uncached=1000)
    assert r.get("a", "m").service == 1.0 and r.get("a", "m").prefill == 2000.0
    r.observe("a", "m", service_s=2.0, first_s=None, uncached=None)
    assert r.get("a", "m").service == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    with caplog.at_level(logging.WARNING, logger="appliance.hub.decide.cost"):
        for _ in range(3):
            r.observe("b", "m", service_s=1e9, first_s=1e-9, uncached=10_000)
    assert r.get("b", "m").service == cost.SERVICE_S_BOUNDS[1]
    assert r.get("b", "m").prefill <= cost.PREFILL_TPS_BOUNDS[1]
    assert len([x for x in caplog.records if "out of bounds" in x.getMessage()]) == 2
    # Too few uncached tokens to say anything of the prefill rate.
    r.observe("c", "m", service_s=None, first_s=0.001, uncached=3)
    assert r.get("c", "m").prefill == cost.DEFAULT_PREFILL_TPS


def test_prefix_held_per_node_longest_and_not_evicted():
    ix = PrefixIndex(100)
    ix.record([1, 2, 3, 4], "a")
    ix.record([1, 2], "b")
    assert {n: b for n, (b, _) in cost.prefix_held(ix, [1, 2, 3, 4, 5]).items()} == {
        "a": 4, "b": 2}
    ix.forget_node("a")
    assert set(cost.prefix_held(ix, [1, 2, 3, 4, 5])) == {"b"}
    assert cost.prefix_held(None, [1]) == {}


def test_homes_bounded():
    h = cost.Homes(capacity=2)
    for i in range(3):
        h.record(bytes([i]), "a", i)
    assert h.get(b"\x00") is None and h.get(b"\x02") == ("a", 2)
