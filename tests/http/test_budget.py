"""http/asgi.py: the decoded size of a body, held against the listener's budget."""

from __future__ import annotations

import json

import pytest

from appliance.http.asgi import BODY_BUDGET, ITEM_BYTES, decoded_estimate, hold_decoded
from appliance.http.errors import ApiError


class Budget:
    """`room` bytes left for decoded estimates; `bound`: the listener's whole budget (the
    body's own bytes, held by the server, within it)."""

    def __init__(self, room: int, bound: int = 1 << 40) -> None:
        self.room, self.held, self.bound = room, 0, bound

    def hold(self, n: int) -> bool:
        if n > self.room - self.held:
            return False
        self.held += n
        return True


def test_estimate_counts_items_not_text():
    prose = json.dumps({"model": "m", "prompt": "x" * 100_000}).encode()
    tiny = json.dumps({"model": "m", "messages": [{"role": "user", "content": "a"}] * 1000},
                      separators=(",", ":")).encode()
    assert decoded_estimate(prose) < len(prose) + 10 * ITEM_BYTES  # a long prompt: its bytes
    assert decoded_estimate(tiny) >= len(tiny) + 4000 * ITEM_BYTES  # 1000 x {, :, ,, :


def test_hold_takes_the_extra_and_refuses_busy_past_the_bound():
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 100}).encode()
    extra = decoded_estimate(body) - len(body)
    b = Budget(extra)
    hold_decoded({"extensions": {BODY_BUDGET: b}}, body)
    assert b.held == extra
    with pytest.raises(ApiError) as e:
        hold_decoded({"extensions": {BODY_BUDGET: b}}, body)
    assert (e.value.status, e.value.code, e.value.retry_after) == (503, "busy", 1.0)
    assert b.held == extra  # nothing more held by the refused one
    hold_decoded({}, body)  # no server budget offered (a test's scope): nothing to do
    hold_decoded(None, body)


def test_a_body_whose_estimate_alone_is_over_the_whole_budget_is_413_not_busy():
    # Retrying never helps it: 413 body_too_large (no Retry-After), not 503 busy.
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 100}).encode()
    estimate, extra = decoded_estimate(body), decoded_estimate(body) - len(body)
    b = Budget(extra - 1, bound=estimate - 1)
    with pytest.raises(ApiError) as e:
        hold_decoded({"extensions": {BODY_BUDGET: b}}, body)
    assert (e.value.status, e.value.code, e.value.retry_after) == (413, "body_too_large", None)
    assert b.held == 0
    b = Budget(extra - 1, bound=estimate)  # exactly the whole budget: others hold the rest
    with pytest.raises(ApiError) as e:
        hold_decoded({"extensions": {BODY_BUDGET: b}}, body)
    assert (e.value.status, e.value.code) == (503, "busy")
