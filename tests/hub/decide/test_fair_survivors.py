"""Fair-queueing mutants that survived issue 30's round (item 10), one test each, on the
lane itself (hub/decide/fair.py)."""

from __future__ import annotations

from typing import Any

from appliance.hub.decide.fair import FairLane


class W:
    def __init__(self, client: str, cost: int = 10, weight: float = 1.0) -> None:
        self.client, self.cost, self.weight = client, cost, weight
        self.fair: Any = None


def test_a_tie_goes_to_the_key_granted_least_recently() -> None:
    # Mutant: the heap orders ties by when keys joined only, ignoring the last grant.
    lane = FairLane()
    a1, a2, b1 = W("a", cost=0), W("a", cost=0), W("b", cost=0)
    for w in (a1, a2, b1):
        lane.add(w)
    assert lane.pop() is a1  # all at 0: a joined first
    assert lane.pop() is b1  # still a tie: b was never granted, a just was
    assert lane.pop() is a2


def test_settle_divides_by_the_weight() -> None:
    # Mutant: the weight ignored at settle (it is not at grant).
    lane = FairLane()
    w = W("a", cost=10, weight=2.0)
    lane.add(w)
    lane.add(W("a"))
    lane.pop()
    assert lane.counters["a"] == 5.0
    lane.settle("a", lane.episode, charged=10, used=30, weight=2.0)
    assert lane.counters["a"] == 15.0


def test_a_settle_from_an_old_episode_is_dropped() -> None:
    # Mutant: the episode check gone: a request granted before the lane emptied charges
    # the key's counter in the next backlog.
    lane = FairLane()
    lane.add(W("a"))
    lane.pop()
    old = lane.episode
    lane.add(W("a"))  # the lane had emptied: a new episode, counters from 0
    lane.add(W("b"))
    assert lane.episode == old + 1 and lane.counters["a"] == 0.0
    lane.settle("a", old, charged=10, used=1000, weight=1.0)
    assert lane.counters["a"] == 0.0


def test_a_settle_reorders_the_waiting_keys() -> None:
    # Mutant: settle changes the counter but not the key's place in the heap.
    lane = FairLane()
    a = [W("a"), W("a")]
    b = [W("b"), W("b")]
    for w in (a[0], b[0], a[1], b[1]):
        lane.add(w)
    assert lane.pop() is a[0] and lane.pop() is b[0]  # both at 10 now
    lane.settle("a", lane.episode, charged=10, used=100, weight=1.0)  # a used far more
    assert lane.pop() is b[1]
