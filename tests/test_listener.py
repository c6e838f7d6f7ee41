"""The listener's plain decisions: body budget, ambiguous framing, which connection to shed."""

from __future__ import annotations

import trio

from appliance.server.listener import Budget, _Guard, _Shed, framing_error


def test_budget_takes_until_the_bound_and_gives_back():
    b = Budget(100)
    assert b.take(60) and b.take(40) and not b.take(1)
    b.give(50)
    assert b.held == 50 and b.take(50) and not b.take(1)
    b.give(1000)
    assert b.held == 0


def test_te_and_cl_together_is_ambiguous_either_case():
    assert framing_error([(b"Transfer-Encoding", b"chunked"), (b"content-length", b"4")])
    assert framing_error([(b"transfer-encoding", b"chunked")]) is None
    assert framing_error([(b"content-length", b"4")]) is None


async def test_shedding_takes_the_oldest_connection_that_serves_no_request():
    live = {}
    guards = [_Guard(10.0) for _ in range(3)]
    for g in guards:
        live[g] = None
    guards[0].request_started()  # serving: never shed
    shed = _Shed()
    assert shed.one(live, 3) and guards[1].cancel.cancel_called and guards[1] not in live
    assert shed.one(live, 3) and guards[2].cancel.cancel_called
    assert not shed.one(live, 3) and not guards[0].cancel.cancel_called and shed.count == 2


async def test_head_deadline_runs_from_the_start_then_from_the_first_byte_after_idle(
    autojump_clock):
    start = trio.current_time()
    g = _Guard(10.0)
    assert g.deadline == start + 10
    g.request_started()
    assert g.deadline == float("inf")
    g.request_done()
    assert g.deadline == float("inf")  # idle: hypercorn's keep-alive bound only
    await trio.sleep(30)
    g.received(b"GET / HT")
    assert g.deadline == start + 40 and g.head_bytes


async def test_a_head_begun_while_the_answer_finished_owes_its_deadline_from_the_request_end(
        autojump_clock):
    g = _Guard(10.0)
    g.request_started()
    g.received(b"a body chunk")  # the request's own body: no head owed
    await trio.sleep(5)
    g.request_done()
    assert g.deadline == float("inf") and not g.head_bytes
    g.request_started()
    g.response_ended()
    g.received(b"GET / HT")  # the next head, read before the request's task finished
    assert g.deadline == float("inf")  # still in the request: not cut
    await trio.sleep(5)
    g.request_done()
    assert g.deadline == trio.current_time() + 10 and g.head_bytes
