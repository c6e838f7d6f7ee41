"""Affinity mutants that survived issue 30's round (item 10), one test each, on the index
and `Affinity.served` (hub/decide/affinity.py)."""

from __future__ import annotations

from appliance.hub.decide.affinity import Affinity, Candidate, PrefixIndex, Route

CHAIN = [11, 22, 33, 44]


def test_the_entry_at_the_watermark_is_gone() -> None:
    # Mutant: `seq < watermark` -- the very entry the engine showed evicted still predicts.
    ix = PrefixIndex(100)
    ix.record(CHAIN, "a")  # written at order 1
    ix.evicted("a", 1)
    assert ix.longest(CHAIN, {"a"}) == (0, "", 0)
    ix.record(CHAIN, "a")  # written again after the eviction: known again
    assert ix.longest(CHAIN, {"a"})[:2] == (4, "a")


def test_a_hit_is_confirmed_against_the_prompt_when_it_is_shorter() -> None:
    # Mutant: confirmed against the expected tokens alone: a prompt shorter than the matched
    # blocks (tokens are more than 4 bytes here) with all of it cached counted as a miss,
    # and its node's entries forgotten.
    aff = Affinity(block=256)
    aff.served("m", Route(chain=list(CHAIN)), "a")  # the index learns: a holds it
    route = Route(chain=list(CHAIN))
    assert aff.choose("m", route, [Cand("a")]) == "a" and route.matched == 4
    route.prompt_tokens, route.cached_tokens = 100, 100  # expected 4 x 256 / 4 = 256
    aff.served("m", route, "a")
    s = aff.stats("m")
    assert (s.predicted, s.confirmed) == (1, 1)
    assert aff.index["m"].longest(CHAIN, {"a"})[:2] == (4, "a")


def test_served_elsewhere_moves_every_prefix_to_the_node_that_served() -> None:
    # Mutant: the blocks before the match kept on the predicted node although another served
    # it -- the next request sharing a shorter prefix is sent to the first node.
    aff = Affinity(block=256)
    aff.served("m", Route(chain=list(CHAIN)), "a")
    route = Route(chain=list(CHAIN))
    assert aff.choose("m", route, [Cand("a"), Cand("b")]) == "a"
    aff.served("m", route, "b")  # the load bound (or a retry) sent it to b after all
    for n in range(1, 5):
        assert aff.index["m"].longest(CHAIN[:n], {"a", "b"})[:2] == (n, "b")


def Cand(name: str) -> Candidate:  # noqa: N802
    return Candidate(name, 0)
