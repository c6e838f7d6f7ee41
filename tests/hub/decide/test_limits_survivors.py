"""Limits mutants that survived issue 30's round (item 10), one test each."""

from __future__ import annotations

import pytest

from appliance.config import ClientConfig
from appliance.http.errors import ApiError
from appliance.hub.decide.limits import Limiter, output_cap


def client(**kw: object) -> ClientConfig:
    return ClientConfig(name="team", key="k", **kw)  # type: ignore[arg-type]


def retry_after(e: ApiError) -> str:
    return {k.decode(): v.decode() for k, v in e.headers()}["retry-after"]


def test_a_settled_request_is_no_longer_pending_so_retry_after_is_the_real_wait() -> None:
    # Mutant: settle leaves `pending` as it was. Then a key whose only request used far
    # less than it reserved is told "retry in 1 s" (its settlement might free room) long
    # after that settlement happened -- the window's real wait is a minute.
    lim = Limiter([client(tpm=1000)], 100)
    lim.admit("team", 0.0, 100, 800).settle((10, 10))  # 900 reserved, 20 used
    assert lim.tenants["team"].pending == 0
    with pytest.raises(ApiError) as e:
        lim.admit("team", 1.0, 90, 900)  # 20 + 990 > 1000
    assert retry_after(e.value) == "60"  # the 20 expire at 60.1


def test_max_tokens_zero_reserves_no_output() -> None:
    # Mutant: a cap of 0 read as "no cap" (falsy), reserving Auth__ReserveOutputTokens.
    assert output_cap({"max_tokens": 0}) == 0
    assert output_cap({"options": {"num_predict": 0}}) == 0
    lim = Limiter([client(tpm=150)], 1024)
    lease = lim.admit("team", 0.0, 100, 0)  # 100 + 0 fits; 100 + 1024 would be a 429
    assert lease.reserved == 100 and lim.tenants["team"].tokens.used(0.0) == 100
