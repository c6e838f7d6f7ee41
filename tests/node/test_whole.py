"""The node's gather (node/whole.py) called with ASGI messages under trio's virtual clock:
a short answer in one body, a long one in pieces at most `hold` apart, bounded in bytes,
anything but a 200 event stream passed through."""

from __future__ import annotations

from appliance.node import whole
from appliance.node.whole import HOLD_SECONDS, Gather, hold_for

SSE = {"type": "http.response.start", "status": 200,
       "headers": [(b"content-type", b"text/event-stream")]}


def body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def gather(hold: float = 1.0) -> tuple[Gather, list[dict]]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
    return Gather(send, hold), sent


async def test_a_short_answer_goes_in_one_body(autojump_clock) -> None:
    g, sent = gather()
    await g(SSE)
    for piece in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
        await g(body(piece))
    assert sent == []  # all held, the head too
    await g(body(b"", more=False))
    assert sent == [SSE, body(b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n", more=False)]


async def test_a_long_answer_goes_in_pieces_at_most_hold_apart(autojump_clock) -> None:
    # The engine's pauses between chunks: the virtual clock moved on, no task waits.
    g, sent = gather(hold=0.25)
    await g(SSE)
    await g(body(b"a"))
    autojump_clock.jump(0.1)
    await g(body(b"b"))
    assert sent == []
    autojump_clock.jump(0.2)  # 0.3 s since the head: the next chunk takes what is held out
    await g(body(b"c"))
    assert sent == [SSE, body(b"abc")]
    await g(body(b"d"))
    autojump_clock.jump(0.25)
    await g(body(b"e"))
    await g(body(b"f"))
    await g(body(b"", more=False))
    assert sent[2:] == [body(b"de"), body(b"f", more=False)]


async def test_past_the_byte_bound_what_is_held_goes_out(monkeypatch, autojump_clock) -> None:
    monkeypatch.setattr(whole, "GATHER_LIMIT", 10)
    g, sent = gather()
    await g(SSE)
    await g(body(b"x" * 8))
    await g(body(b"y" * 8))
    assert sent == [SSE, body(b"x" * 8 + b"y" * 8)]


async def test_anything_but_a_200_event_stream_passes_through(autojump_clock) -> None:
    for start in ({"type": "http.response.start", "status": 502,
                   "headers": [(b"content-type", b"text/event-stream")]},
                  {"type": "http.response.start", "status": 200,
                   "headers": [(b"content-type", b"application/x-ndjson")]}):
        g, sent = gather()
        await g(start)
        await g(body(b"one"))
        assert sent == [start, body(b"one")]


def test_the_hold_is_a_quarter_of_the_hubs_bound_at_most_a_second() -> None:
    assert hold_for([(b"x-appliance-whole", b"600")]) == HOLD_SECONDS == 1.0
    assert hold_for([(b"accept", b"*/*"), (b"x-appliance-whole", b"2")]) == 0.5
    assert hold_for([(b"accept", b"*/*")]) is None
    for bad in (b"0", b"-1", b"nan", b"inf", b"soon", b"1" * 17):
        assert hold_for([(b"x-appliance-whole", bad)]) is None
