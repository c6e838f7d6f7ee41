"""HA fencing on the node (node/fence.py): a deposed leader stays refused while the live
one asserts its epoch; a forged epoch fences the live leader out for at most one lease."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.node.fence import MAX_LEASE_SECONDS, MIN_LEASE_SECONDS, Fence, parse_lease

LEASE = 10.0


def test_higher_or_equal_epochs_go_ahead_and_a_lower_one_is_refused_while_alive():
    f = Fence()
    assert f.check(100, LEASE, 0.0) == ""
    assert f.check(100, LEASE, 1.0) == ""
    assert f.check(120, LEASE, 2.0) == ""  # a new leader
    why = f.check(100, LEASE, 3.0)  # the deposed one, waking up
    assert "older than 120" in why and f.epoch == 120


def test_a_live_leader_asserting_each_tick_keeps_a_deposed_one_out_for_good():
    f = Fence()
    f.check(100, LEASE, 0.0)
    f.check(120, LEASE, 0.5)
    for tick in range(1, 200):  # the new leader re-asserts every 2.5 s for 500 s
        now = tick * 2.5
        assert f.check(120, LEASE, now) == ""
        assert f.check(100, LEASE, now + 1.0) != ""
    assert f.epoch == 120 and f.forgotten == 0


def test_a_forged_epoch_fences_the_leader_out_for_one_lease_at_most():
    f = Fence()
    f.check(120, LEASE, 0.0)
    assert f.check(999_999_999_999, 3600.0, 1.0) == ""  # a token holder's forgery
    refused = [t for t in range(2, 40) if f.check(120, LEASE, float(t)) != ""]
    # Refused while the forgery is younger than the leader's lease, then taken back.
    assert refused == list(range(2, 12)), refused
    assert f.epoch == 120 and f.forgotten == 1


def test_a_forged_lease_cannot_stretch_nor_shrink_a_lease_past_the_bounds():
    f = Fence()
    f.check(999, LEASE, 0.0)
    # A caller claiming a lease of 0 s cannot declare a just-asserted epoch dead...
    assert f.check(5, 0.0, 0.5) != ""
    # ...and a claimed lease of a year is taken as the cap.
    assert f.check(5, 10**9, MAX_LEASE_SECONDS + 1) == ""
    assert MIN_LEASE_SECONDS > 0


def test_out_of_range_epochs_are_refused():
    f = Fence()
    assert f.check(0, LEASE, 0.0) != "" and f.check(2**63, LEASE, 0.0) != ""
    assert f.epoch == 0


def test_lease_header_parsing_is_bounded():
    assert parse_lease(None, 10.0) == 10.0
    assert parse_lease(b"2.5", 10.0) == 2.5
    for bad in (b"nan", b"inf", b"x", b"1" * 17):
        assert parse_lease(bad, 10.0) == 10.0


@given(st.lists(st.tuples(st.integers(1, 10**6), st.floats(0, 50)), max_size=60))
def test_the_epoch_kept_was_asserted_within_the_largest_lease(calls):
    # Whatever the callers send, the epoch the fence keeps was heard no longer ago than the
    # lease cap: nothing fences a node for longer.
    f = Fence()
    now = 0.0
    for epoch, step in calls:
        now += step
        f.check(epoch, LEASE, now)
        assert now - f.heard <= MAX_LEASE_SECONDS
