"""The long-running fuzz of the HTTP/1.1 codec (appliance/h1/), outside `make test`: the same
properties as tests/h1/test_h1parse.py -- h11 (>= 0.16) as the oracle -- with a large
hypothesis budget, as h11's own fuzz/ does with afl. Run it when the parser changes:

    make fuzz                      # FUZZ_EXAMPLES=20000 per property (minutes)
    FUZZ_EXAMPLES=200000 make fuzz # overnight

What must hold for every input: a request head is refused (BadRequest with a 4xx/5xx
status) or read exactly as h11 reads it, never accepted where h11 refuses; a chunked body
split in any pieces reads back whole, and garbage raises only BodyError and never yields
more than it was given; a response head is refused (BrokenResponse) or read with h11's
status and framing; nothing else escapes. A failure prints the smallest input hypothesis
found (add it to tests/h1/ as a fast case).
"""

from __future__ import annotations

import os

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.h1.body import BodyError, ChunkedBody
from appliance.h1.parse import BrokenResponse, parse_response_head
from tests.h1.test_h1parse import EDIT, check, encode_chunked, header_lists, mutate, request_lines

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "20000"))
LONG = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))

MUTATIONS = st.lists(EDIT, max_size=6)


@LONG
@given(request_lines, st.sampled_from([b"Host: hub", b"", b"Host: a\r\nHost: b"]), header_lists,
       MUTATIONS)
def test_request_heads(line, host, headers, edits):
    fields = ([(b"", b"", host)] if host else []) + headers
    check(mutate(line + b"".join(b"\r\n" + n + sep + v for n, sep, v in fields), edits))


@LONG
@given(st.binary(max_size=5000), st.lists(st.integers(1, 900), max_size=12), st.booleans(),
       st.lists(st.integers(1, 600), min_size=1, max_size=40))
def test_chunked_bodies_in_any_pieces(body, sizes, ext, cuts):
    wire = encode_chunked(body, sizes, ext)
    c, got, pos = ChunkedBody(), b"", 0
    for n in cuts * (len(wire) // sum(cuts) + 2):
        got += c.feed(wire[pos:pos + n])
        pos += n
        if c.done:
            break
    assert c.done and got == body and c.error is None


@LONG
@given(st.binary(max_size=600), MUTATIONS, st.integers(0, 1024))
def test_garbage_and_mutated_chunked_bodies(noise, edits, min_average):
    for wire in (noise, mutate(encode_chunked(b"x" * 300, [7, 100, 3], True), edits)):
        c = ChunkedBody(min_average)
        try:
            data = c.feed(wire)
            if c.error is not None:
                raise c.error
        except BodyError:
            continue
        assert len(data) + len(c.leftover) <= len(wire)


RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked"
            b"\r\nX-Request-Id: abc\r\n\r\n")


def h11_response(head: bytes) -> h11.Response | h11.InformationalResponse | None:
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"),
                                                               ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(head)
    try:
        ev = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    return ev if isinstance(ev, (h11.Response, h11.InformationalResponse)) else None


@LONG
@given(MUTATIONS)
def test_response_heads(edits):
    head = mutate(RESPONSE, edits)
    try:
        got = parse_response_head(head)
    except BrokenResponse:
        return
    if got is None:  # incomplete: no blank line yet
        assert b"\r\n\r\n" not in head
        return
    theirs = h11_response(head[:got[1]])
    assert theirs is not None, head  # never accept what h11 refuses
    assert got[0].status_code == theirs.status_code
