"""Issue 30 item 8, the HTTP parts: ordinary streamed uploads pass the chunk bound (it bounds
the framing's CPU per byte, not the count of chunks), and a repeated Authorization or
X-Api-Key header is refused 400 (a proxy in front may read the other one) -- on plain and
TLS listeners (`wire`) and on the sans-I/O parser."""

from __future__ import annotations

import json

import pytest

from appliance.h1.body import FREE_CHUNKS, MIN_AVERAGE_CHUNK, BodyError, ChunkedBody
from appliance.h1.parse import BadRequest, BrokenResponse, parse_head, parse_response_head
from tests.server.test_h1 import answer, echo

MB = 1 << 20


def chunked(payload: bytes, size: int) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(payload[i:i + size]), payload[i:i + size])
                    for i in range(0, len(payload), size)) + b"0\r\n\r\n"


@pytest.mark.parametrize("size", [512, 256, 128])
def test_a_megabyte_in_small_chunks_passes_the_bound(size):
    body = ChunkedBody(MIN_AVERAGE_CHUNK)
    data = chunked(b"u" * MB, size)
    got = b"".join(body.feed(data[i:i + 65536]) for i in range(0, len(data), 65536))
    assert body.error is None and body.done and len(got) == MB


def test_chunks_below_the_bound_are_still_refused():
    body = ChunkedBody(MIN_AVERAGE_CHUNK)
    with pytest.raises(BodyError, match="chunks"):
        body.feed(chunked(b"u" * (MIN_AVERAGE_CHUNK // 2) * (FREE_CHUNKS + 10),
                          MIN_AVERAGE_CHUNK // 2))
        if body.error is not None:
            raise body.error


async def test_a_streamed_upload_of_512_byte_chunks_is_served(wire):
    raw = await answer(wire, echo,
                       b"POST /v1/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                       b"Connection: close\r\n\r\n" + chunked(b"u" * MB, 512))
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["n"] == MB


@pytest.mark.parametrize("fields", [
    b"Authorization: Bearer a\r\nAuthorization: Bearer b",
    b"authorization: Bearer a\r\nX-Other: 1\r\nAUTHORIZATION: Bearer a",
    b"X-Api-Key: a\r\nx-api-key: b",
])
def test_a_repeated_key_header_is_refused(fields):
    with pytest.raises(BadRequest) as e:
        parse_head(b"POST / HTTP/1.1\r\nHost: x\r\n" + fields)
    assert e.value.status == 400


def test_one_authorization_and_one_x_api_key_are_accepted():
    h = parse_head(b"POST / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nX-Api-Key: b")
    assert (b"authorization", b"Bearer a") in h.headers and (b"x-api-key", b"b") in h.headers


async def test_a_repeated_authorization_is_400_on_the_wire(wire):
    raw = await answer(wire, echo, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a"
                                   b"\r\nAuthorization: Bearer b\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400"), raw[:200]
    assert b"Authorization" in raw


@pytest.mark.parametrize("reason", [b"\x00K", b"O\x7fK", b"O\x01K"])
def test_a_control_byte_in_a_reason_phrase_is_refused_as_h11_does(reason):
    # found by `make fuzz` (fuzz/test_h1_fuzz.py::test_response_heads)
    with pytest.raises(BrokenResponse):
        parse_response_head(b"HTTP/1.1 200 " + reason + b"\r\nContent-Length: 0\r\n\r\n")
    got = parse_response_head(b"HTTP/1.1 200 O\tK \x80\r\nContent-Length: 0\r\n\r\n")
    assert got is not None and got[0].status_code == 200
