"""The relay's own body readers (appliance/h1/body.py): a peer's chunked body, split
anywhere, gives back exactly its payload; every broken frame is BodyError at once, and
nothing is ever buffered beyond one line."""

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.h1.body import MAX_LINE, MAX_TRAILERS, BodyError, ChunkedBody, SizedBody


def feed_all(parts: list[bytes]) -> tuple[bytes, ChunkedBody]:
    """Feed `parts` as a reader does: a pending error is raised before the next read."""
    body = ChunkedBody()
    out = b""
    for p in parts:
        if body.error is not None:
            body.feed(b"")
        out += body.feed(p)
    if body.error is not None:
        body.feed(b"")
    return out, body


def test_payload_before_a_break_in_the_same_read_comes_first_then_the_error():
    body = ChunkedBody()
    assert body.feed(b"2\r\nok\r\nzz\r\n") == b"ok"
    assert body.error is not None
    with pytest.raises(BodyError):
        body.feed(b"")
    with pytest.raises(BodyError):
        body.feed(b"2\r\nok\r\n")  # and it stays broken


def h11_encoded(payloads: list[bytes], trailers: list[tuple[bytes, bytes]] = ()) -> bytes:
    """The body as h11 (the server side of every peer we talk to) frames it."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    conn.next_event()
    conn.next_event()
    conn.send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
    out = b"".join(conn.send(h11.Data(data=p)) for p in payloads)
    return out + conn.send(h11.EndOfMessage(headers=list(trailers)))


SSE = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
BODY = (b"%x\r\n%b\r\n" % (len(SSE), SSE)) * 3 + b"5;name=val\r\nhello\r\n0\r\nx-t: 1\r\n\r\n"
PAYLOAD = SSE * 3 + b"hello"


def test_a_whole_frame_per_read_gives_its_payload():
    body = ChunkedBody()
    frame = b"%x\r\n%b\r\n" % (len(SSE), SSE)
    assert body.feed(frame) == SSE
    assert body.feed(frame + frame) == SSE + SSE
    assert not body.done
    assert body.feed(b"0\r\n\r\n") == b"" and body.done and body.leftover == b""


@pytest.mark.parametrize("cut", range(len(BODY) + 1))
def test_split_at_every_byte_boundary(cut):
    out, body = feed_all([BODY[:cut], BODY[cut:]])
    assert out == PAYLOAD and body.done and body.leftover == b""


def test_one_byte_at_a_time():
    out, body = feed_all([BODY[i:i + 1] for i in range(len(BODY))])
    assert out == PAYLOAD and body.done


@settings(max_examples=300, deadline=None)
@given(payloads=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
       trailers=st.lists(st.tuples(st.sampled_from([b"x-a", b"x-b", b"etag"]),
                                   st.binary(min_size=0, max_size=20).map(
                                       lambda b: bytes(c for c in b if 0x21 <= c < 0x7f))),
                         max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_any_h11_framed_body_split_anywhere(payloads, trailers, cuts):
    wire = h11_encoded(payloads, trailers)
    points = sorted({min(c, len(wire)) for c in cuts})
    parts = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    out, body = feed_all(parts)
    assert out == b"".join(payloads)
    assert body.done and body.leftover == b""


@pytest.mark.parametrize("bad", [
    b"x\r\n", b"-1\r\n", b"+5\r\n", b"0x5\r\n", b"\r\n", b";ext\r\n", b" 5\r\n",
    b"5\nhello\r\n",  # a bare LF
    b"1" * 17 + b"\r\n",  # more hex digits than any size
    b"5\r\nhelloXY",  # data not followed by CRLF
    b"5\r\nhello\rX",
    b"5;a\rb\r\n",  # a stray CR in the extensions
    b"0\r\nnot a header\r\n\r\n",  # a trailer that is not a field
])
def test_broken_framing_is_an_error(bad):
    with pytest.raises(BodyError):
        feed_all([bad])
    # and split anywhere, too: the error is never lost between reads
    for cut in range(1, len(bad)):
        with pytest.raises(BodyError):
            feed_all([bad[:cut], bad[cut:]])


def test_a_size_line_without_end_is_bounded():
    body = ChunkedBody()
    body.feed(b"1" * 8)  # an incomplete line is kept ...
    with pytest.raises(BodyError):
        body.feed(b"2" * MAX_LINE)  # ... up to MAX_LINE, then it is an error, not a buffer
    with pytest.raises(BodyError):
        ChunkedBody().feed(b"5;" + b"e" * (MAX_LINE + 10))


def test_trailers_are_bounded():
    body = ChunkedBody()
    body.feed(b"0\r\n")
    line = b"x-pad: " + b"p" * 1000 + b"\r\n"
    with pytest.raises(BodyError):
        for _ in range(MAX_TRAILERS // len(line) + 2):
            body.feed(line)
    with pytest.raises(BodyError):
        ChunkedBody().feed(b"0\r\nx-a: " + b"p" * (MAX_LINE + 10))


def test_a_truncated_body_is_not_done():
    for cut in range(len(BODY)):
        out, body = feed_all([BODY[:cut]])
        assert not body.done  # the caller meets the peer's close: an error, not an end
        assert PAYLOAD.startswith(out)


def test_a_large_chunk_is_passed_on_as_it_arrives_not_buffered():
    body = ChunkedBody()
    assert body.feed(b"100000\r\n" + b"a" * 1000) == b"a" * 1000
    assert body.feed(b"b" * 5000) == b"b" * 5000
    assert body._buf == b""  # nothing kept between reads but the count owed


def test_bytes_after_the_last_chunk_are_leftover():
    out, body = feed_all([b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n"])
    assert out == b"abc" and body.done and body.leftover == b"HTTP/1.1 200 OK\r\n"
    assert body.feed(b"more") == b"" and body.leftover.endswith(b"more")


def test_sized_body():
    body = SizedBody(5)
    assert body.feed(b"he") == b"he" and not body.done
    assert body.feed(b"llo!!") == b"llo" and body.done and body.leftover == b"!!"
    assert SizedBody(0).done
