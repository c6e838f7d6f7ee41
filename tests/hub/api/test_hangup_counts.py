"""A request its client hung up mid-answer is counted and charged (issue 31 item 1), as
plain calls: the key's lease settles from the hub's count, and a count beyond what was
reserved is charged to the minute and the day too; the request record settles a 499 that
relayed something from what was relayed, and one that relayed nothing as nothing used.
The end-to-end half (every API, the audit line) is tests/e2e/test_hangup_counts_e2e.py."""

from __future__ import annotations

from typing import Any

from appliance.config import ClientConfig
from appliance.hub.api.request import Request
from appliance.hub.decide import limits
from appliance.hub.decide.limits import Limiter
from appliance.hub.translate.usage import Usage


def _limiter() -> Limiter:
    return Limiter([ClientConfig(name="team", key="k", tpm=100_000)], 300)  # type: ignore[call-arg]


def test_a_count_beyond_the_reservation_is_charged_to_the_windows() -> None:
    lim = _limiter()
    lease = lim.admit("team", 0.0, 40, None)  # 40 bytes in + 300 reserved for the answer
    u = lease.settle(None, (10, 900))  # hung up after 900 pieces: no usage from the engine
    assert u == limits.Settled(10, 900, True)
    t = lim.tenants["team"]
    assert t.tokens.used(0.0) == 910 and t.day.used(0.0) == 910
    assert t.served_out == 900


def test_a_count_within_the_reservation_keeps_the_reservation() -> None:
    lim = _limiter()
    lim.admit("team", 0.0, 40, None).settle(None, (10, 100))
    assert lim.tenants["team"].tokens.used(0.0) == 340


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[Request] = []

    def record(self, req: Request) -> None:
        self.seen.append(req)


def _request(lim: Limiter) -> tuple[Request, _Recorder]:
    async def send(msg: dict[str, Any]) -> None:
        pass

    rec = _Recorder()
    scope = {"type": "http", "path": "/v1/chat/completions", "headers": []}
    req = Request(scope, send, "openai", rec)  # type: ignore[arg-type]
    req.lease = lim.admit("team", 0.0, 40, None)
    req.node = "n1"
    return req, rec


def test_a_hangup_mid_answer_settles_what_was_relayed() -> None:
    lim = _limiter()
    req, rec = _request(lim)
    req.status, req.error = 499, "client_disconnected"
    req.usage = Usage(10, 102, 0, estimated=True)  # the relay's count when it was cut
    req.finish()
    assert rec.seen == [req]
    assert req.tokens == limits.Settled(10, 102, True)
    assert lim.tenants["team"].served_out == 102


def test_a_hangup_before_the_answer_used_nothing() -> None:
    lim = _limiter()
    req, _ = _request(lim)
    req.status, req.error = 499, "client_disconnected"  # gone while queued: no usage
    req.finish()
    assert req.tokens == limits.Settled(0, 0, False)
    assert lim.tenants["team"].tokens.used(0.0) == 0
