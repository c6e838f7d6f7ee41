"""Per-key limits (hub/decide/limits.py): windows, reserve and settle, refusals, headers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance import config
from appliance.config import ClientConfig
from appliance.http.errors import ApiError
from appliance.hub.decide import limits
from appliance.hub.decide.limits import Limiter, Window, output_cap


def client(**kw: object) -> ClientConfig:
    return ClientConfig(name="team", key="k", **kw)  # type: ignore[arg-type]


def hdr(e: ApiError) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in e.headers()}


def test_window_counts_the_last_minute_and_one_bin() -> None:
    w = Window(60, 0.1)
    w.add(10.0, 5)
    w.add(30.0, 7)
    assert w.used(30.0) == 12
    assert w.used(70.05) == 12  # 10.0's bin lasts a minute and one bin
    assert w.used(70.11) == 7
    assert w.used(90.1) == 0


def test_window_wait_is_when_the_oldest_bins_expire() -> None:
    w = Window(60, 0.1)
    w.add(0.0, 4)
    w.add(20.0, 4)
    assert w.wait(25.0, 2, 10) == 0.0
    assert w.wait(25.0, 4, 10) == pytest.approx(35.1)  # the first 4 expire at 60.1
    assert w.wait(25.0, 9, 10) == pytest.approx(55.1)
    assert math.isinf(w.wait(25.0, 11, 10))


def test_rpm_refuses_with_retry_after_to_the_second() -> None:
    lim = Limiter([client(rpm=2)], 100)
    lim.admit("team", 0.0, 10, 5).settle((1, 1))
    lim.admit("team", 12.3, 10, 5).settle((1, 1))
    with pytest.raises(ApiError) as e:
        lim.admit("team", 30.0, 10, 5)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    h = hdr(e.value)
    assert h["retry-after"] == "31"  # the first expires at 60.1: 30.1 s from now, rounded up
    assert h["x-ratelimit-limit-requests"] == "2"
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-reset-requests"] == "43s"  # 12.3's bin expires at 72.4
    assert h["anthropic-ratelimit-requests-limit"] == "2"
    lim.admit("team", 60.1, 10, 5)  # really admitted when Retry-After said


def test_tokens_reserve_at_admission_and_settle_down() -> None:
    lim = Limiter([client(tpm=1000)], 100)
    a = lim.admit("team", 0.0, 100, 500)  # 100 bytes in + 500 cap
    assert lim.tenants["team"].tokens.used(0.0) == 600
    with pytest.raises(ApiError) as e:
        lim.admit("team", 1.0, 100, 500)
    assert e.value.kind == "tokens" and hdr(e.value)["x-ratelimit-remaining-tokens"] == "400"
    a.settle((30, 10))
    assert lim.tenants["team"].tokens.used(1.0) == 40
    lim.admit("team", 1.0, 100, 500)


def test_running_requests_that_will_settle_make_retry_after_a_second() -> None:
    lim = Limiter([client(tpm=1000)], 100)
    done = lim.admit("team", 0.0, 100, 400)
    done.settle((20, 30))  # 50 used: stays in the window for a minute
    running = lim.admit("team", 1.0, 100, 400)  # 500 reserved, still running
    with pytest.raises(ApiError) as e:
        lim.admit("team", 2.0, 100, 400)
    assert hdr(e.value)["retry-after"] == "1"  # its settlement may free the room any time
    running.settle((20, 30))
    lim.admit("team", 3.0, 100, 400)  # and it did
    lim2 = Limiter([client(tpm=1000)], 100)
    lim2.admit("team", 0.0, 100, 400).settle((100, 400))
    lim2.admit("team", 10.0, 100, 400).settle((100, 400))
    with pytest.raises(ApiError) as e:  # all settled: exact, the first expires at 60.1
        lim2.admit("team", 20.0, 100, 400)
    assert hdr(e.value)["retry-after"] == "41"


def test_fair_queueing_charges_what_the_key_recently_used() -> None:
    # The lease is the request's fair-queueing demand, found with the same tenant at
    # admission: the charge and the key's weight, and once settled what it really cost
    # (fair.py's Demand, read when the place is given back).
    lim = Limiter([client(weight=2.0)], 1000)
    first = lim.admit("team", 0.0, 400, 500)
    assert (first.cost, first.weight, first.used) == (100 + 2 * 500, 2.0, None)  # the cap
    first.settle((40, 60))
    assert first.used == 40 + 2 * 60
    for _ in range(30):
        lim.admit("team", 0.0, 400, 500).settle((40, 60))
    lease = lim.admit("team", 0.0, 400, 500)
    assert abs(lease.cost - (40 + 2 * 60)) <= 3 and lease.weight == 2.0
    assert lim.admit("team", 0.0, 400, 10).cost <= 40 + 2 * 10 + 3  # never more than the cap


def test_no_usage_keeps_the_reservation() -> None:
    lim = Limiter([client(tpm=1000)], 300)
    lease = lim.admit("team", 0.0, 40, None)  # 40 bytes in + 300 reserved for the answer
    u = lease.settle(None)
    assert u == limits.Settled(10, 0, True)  # reported: the input's estimate, bytes / 4
    assert lim.tenants["team"].tokens.used(0.0) == 340


def test_no_cap_charges_what_the_answer_really_used() -> None:
    lim = Limiter([client(tpm=1000)], 300)
    lim.admit("team", 0.0, 40, None).settle((10, 900))
    assert lim.tenants["team"].tokens.used(0.0) == 910
    with pytest.raises(ApiError):
        lim.admit("team", 0.0, 40, None)


def test_an_engine_that_lies_is_clamped_to_the_possible() -> None:
    lim = Limiter([client(tpm=100_000)], 300)
    lease = lim.admit("team", 0.0, 400, 50)
    u = lease.settle((10**9, 10**9))
    assert u == limits.Settled(400, 50, False)
    lease2 = lim.admit("team", 0.0, 400, 50)
    assert lease2.settle((-5, -5)) == limits.Settled(0, 0, False)
    assert lease2.settle((1, 1)) == limits.Settled(0, 0, True)  # settled once


def test_limit_zero_refuses_without_retry() -> None:
    lim = Limiter([client(tpm=0)], 10)
    with pytest.raises(ApiError) as e:
        lim.admit("team", 0.0, 4, 1)
    h = hdr(e.value)
    assert "retry-after" not in h and h["x-should-retry"] == "false"
    assert "is 0" in e.value.message


def test_a_request_bigger_than_the_limit_is_told_so() -> None:
    lim = Limiter([client(tpm=6000)], 10)
    with pytest.raises(ApiError) as e:
        lim.admit("team", 0.0, 40, 10_000)
    assert "lower max_tokens" in e.value.message and "retry-after" not in hdr(e.value)


def test_max_concurrent() -> None:
    lim = Limiter([client(max_concurrent=1)], 10)
    a = lim.admit("team", 0.0, 4, 1)
    with pytest.raises(ApiError) as e:
        lim.admit("team", 0.0, 4, 1)
    assert hdr(e.value)["retry-after"] == "1"
    a.settle((1, 1))
    lim.admit("team", 0.0, 4, 1)


def test_unknown_keys_have_no_limits() -> None:
    lim = Limiter([client(rpm=0)], 10)
    for _ in range(100):
        lim.admit("anonymous", 0.0, 4, 1)


def test_each_hub_enforces_its_share() -> None:
    hubs = [3]
    lim = Limiter([client(rpm=10)], 10, hubs=lambda: hubs[0])
    for _ in range(3):
        lim.admit("team", 0.0, 4, 1)
    with pytest.raises(ApiError):
        lim.admit("team", 0.0, 4, 1)
    hubs[0] = 1
    lim.admit("team", 0.0, 4, 1)
    assert limits.share(1, 5) == 1 and limits.share(0, 5) == 0


def test_output_cap_fields_and_bad_values() -> None:
    assert output_cap({"max_tokens": 7}) == 7
    assert output_cap({"max_output_tokens": 9}) == 9
    assert output_cap({"options": {"num_predict": 12}}) == 12
    assert output_cap({"options": {"num_predict": -1}}) is None
    assert output_cap({"max_tokens": "x"}) is None
    for bad in (-1, limits.MAX_OUTPUT_CAP + 1):
        with pytest.raises(ApiError) as e:
            output_cap({"max_tokens": bad})
        assert e.value.status == 400 and e.value.param == "max_tokens"


def test_config_refuses_bad_limits() -> None:
    for var, value in (("Rpm", "-1"), ("Tpm", "99999999999999"), ("MaxConcurrent", "x"),
                       ("Weight", "0")):
        with pytest.raises(config.ConfigError, match=f"Auth__Clients__0__{var}"):
            config.load({"Auth__Clients__0__Key": "k", f"Auth__Clients__0__{var}": value})
    with pytest.raises(config.ConfigError, match="same key"):
        config.load({"Auth__Clients__0__Key": "k", "Auth__Clients__1__Key": "k"})


# --- the property: no minute overshoots by more than one request's cap --------------------

step = st.tuples(st.floats(0, 5), st.integers(0, 4000), st.integers(0, 800),
                 st.one_of(st.none(), st.tuples(st.integers(-10, 10**6), st.integers(-10, 10**6))),
                 st.booleans())


@settings(max_examples=200, deadline=None)
@given(st.lists(step, max_size=120), st.integers(1, 20_000))
def test_any_minute_stays_within_limit_plus_one_cap(
        steps: list[tuple[float, int, int, tuple[int, int] | None, bool]], tpm: int) -> None:
    """Admits and settles in any order, with any usage the engine claims (lies included):
    the tokens counted for the requests admitted in any 60 s stay within the limit plus one
    request's cap (in fact within the limit: every request here names its cap)."""
    lim = Limiter([client(tpm=tpm)], 256)
    now = 0.0
    running: list[tuple[float, limits.Lease]] = []
    served: list[tuple[float, int]] = []  # (admitted at, tokens finally counted)
    biggest_cap = 0
    for dt, body, cap, used, finish_one in steps:
        now += dt
        if finish_one and running:
            at, lease = running.pop(0)
            u = lease.settle(used)
            served.append((at, u.input + u.output))
        try:
            lease = lim.admit("team", now, body, cap)
        except ApiError as e:
            assert e.status == 429
            continue
        biggest_cap = max(biggest_cap, cap)
        running.append((now, lease))
    served += [(at, lease.reserved) for at, lease in running]
    for start, _ in served:
        in_minute = sum(n for t, n in served if start <= t < start + 60)
        assert in_minute <= tpm <= tpm + biggest_cap
