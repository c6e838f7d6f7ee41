"""The listener's plain decisions: body budget, which connection to shed, the connection's
state table (appliance/server/receive.py, accept.py; appliance/h1/state.py)."""

from __future__ import annotations

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from appliance.h1.errors import LocalProtocolError as ProtocolError
from appliance.h1.state import (
    BODY_END,
    CHUNKED,
    DONE,
    ERROR,
    MUST_CLOSE,
    PEER_CLOSED,
    REQUEST,
    REQUEST_NO_BODY,
    RESPONSE,
    RESPONSE_END,
    SEND_BODY,
    SIZED,
    Cycle,
)
from appliance.server.receive import Budget
from appliance.server.serve import Shed


class Slot:
    """What the shedding reads of a connection (appliance/server/connection.py's Conn)."""

    def __init__(self) -> None:
        self.in_request = False
        self.cancel = trio.CancelScope()


def test_budget_takes_until_the_bound_and_gives_back():
    b = Budget(100)
    assert b.take(60) and b.take(40) and not b.take(1)
    b.give(50)
    assert b.held == 50 and b.take(50) and not b.take(1)
    b.give(1000)
    assert b.held == 0


async def test_shedding_takes_the_oldest_connection_that_serves_no_request():
    slots = [Slot() for _ in range(3)]
    live = dict.fromkeys(slots)
    slots[0].in_request = True  # serving: never shed
    shed = Shed()
    assert shed.one(live, 3) and slots[1].cancel.cancel_called and slots[1] not in live
    assert shed.one(live, 3) and slots[2].cancel.cancel_called
    assert not shed.one(live, 3) and not slots[0].cancel.cancel_called and shed.count == 2


def test_a_clean_cycle_is_reusable_and_starts_again():
    c = Cycle()
    c.client(REQUEST)
    c.server(RESPONSE)
    assert not c.reusable and c.body_owed
    c.client(BODY_END)
    c.server(RESPONSE_END)
    assert c.reusable
    c.next_cycle()
    c.client(REQUEST_NO_BODY)
    assert (c.their, c.ours) == (DONE, "SEND_RESPONSE")


def test_close_and_early_answers_and_hang_ups_end_the_connection():
    c = Cycle()
    c.client(REQUEST)
    c.server(RESPONSE)
    c.server(RESPONSE_END)  # answered before the body came
    assert c.answered and c.their == SEND_BODY and not c.reusable
    c.client(PEER_CLOSED)  # ... and the client left mid-body
    assert c.their == ERROR and not c.reusable
    with pytest.raises(ProtocolError):
        c.client(BODY_END)  # ERROR never changes again
    c = Cycle()
    c.client(REQUEST_NO_BODY)
    c.close()  # `connection: close` either way
    c.server(RESPONSE)
    c.server(RESPONSE_END)
    assert (c.their, c.ours) == (MUST_CLOSE, MUST_CLOSE) and not c.reusable
    with pytest.raises(ProtocolError):
        c.next_cycle()


def test_the_table_holds_the_cycles_facts_and_starts_them_afresh():
    c = Cycle()
    assert (c.framing, c.owed, c.sent_end, c.end_given, c.eof, c.linger) == (
        "", 0, False, False, False, False)
    c.client(REQUEST_NO_BODY)
    c.respond(SIZED, 5, close=False)  # the head is decided: the server sends its body
    assert (c.ours, c.framing, c.owed, c.keep_alive) == ("SEND_BODY", SIZED, 5, True)
    c.owed, c.sent_end, c.end_given = 0, True, True
    c.server(RESPONSE_END)
    c.next_cycle()  # the next request's facts start afresh; the connection's stay
    assert (c.framing, c.owed, c.sent_end, c.end_given) == ("", 0, False, False)
    c.client(REQUEST)
    c.respond(CHUNKED, 0, close=True)  # a streamed answer that ends the connection
    assert (c.ours, c.framing, c.keep_alive) == ("SEND_BODY", CHUNKED, False)
    c.peer_closed()  # mid-body: only noted (the body reader calls the body BROKEN)
    assert c.eof and c.their == SEND_BODY
    c = Cycle()
    c.peer_closed()  # between requests: the client's side is CLOSED
    assert c.eof and c.their == "CLOSED"
    c.peer_closed()  # once
    assert c.their == "CLOSED"


CLIENT_EVENTS = [REQUEST, REQUEST_NO_BODY, BODY_END, PEER_CLOSED, "BROKEN"]
SERVER_EVENTS = [RESPONSE, RESPONSE_END, "BROKEN"]


@given(st.lists(st.one_of(st.tuples(st.just("client"), st.sampled_from(CLIENT_EVENTS)),
                          st.tuples(st.just("server"), st.sampled_from(SERVER_EVENTS)),
                          st.tuples(st.just("close"), st.just("")),
                          st.tuples(st.just("next"), st.just(""))), max_size=30))
def test_the_table_never_reuses_a_connection_it_must_close(steps):
    """Whatever happens in whatever order: a step the table forbids raises (and changes
    nothing); ERROR and CLOSED are final; the next cycle starts only when both sides are
    DONE; once keep-alive is off, no cycle follows."""
    c = Cycle()
    for who, ev in steps:
        before = (c.their, c.ours, c.keep_alive)
        try:
            if who == "client":
                c.client(ev)
            elif who == "server":
                c.server(ev)
            elif who == "close":
                c.close()
            else:
                assert c.reusable == (before[0] == before[1] == DONE)
                c.next_cycle()
                assert (c.their, c.ours) == ("IDLE", "IDLE") and c.keep_alive
        except ProtocolError:
            assert (c.their, c.ours, c.keep_alive) == before
            continue
        if before[0] in (ERROR, "CLOSED"):
            assert c.their == before[0]
        if not c.keep_alive:
            assert not c.reusable
        assert not (c.reusable and SEND_BODY in (c.their, c.ours))
