"""http/budget.py: the decoded size of a body, held against the listener's budget."""

from __future__ import annotations

import json

import pytest

from appliance.http.budget import BODY_BUDGET, ITEM_BYTES, decoded_estimate, hold_decoded
from appliance.http.errors import ApiError


class Budget:
    def __init__(self, room: int) -> None:
        self.room, self.held = room, 0

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
