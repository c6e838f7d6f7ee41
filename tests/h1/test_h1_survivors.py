"""The grammar mutants that survived issue 30's round (item 10), each killed by a fast test:
the chunk bound counted on the one-frame-per-read path and exact at its threshold, a body
of exactly the bound accepted, a head over the bound without any CRLF answered 414, a
target of exactly MAX_TARGET accepted, and `http://host?q` keeping its query."""

from __future__ import annotations

import json

import pytest

from appliance.h1.body import FREE_CHUNKS, MIN_AVERAGE_CHUNK, BodyError, ChunkedBody
from appliance.h1.parse import MAX_TARGET, BadRequest, parse_head
from appliance.http.asgi import BodyTooLarge, read_body
from appliance.server.serve import Settings
from tests.server.test_h1 import answer, echo


def chunk(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def feed_each(body: ChunkedBody, frames: list[bytes]) -> bytes:
    """Each frame in a read of its own (the reader's one-frame fast path), as a client
    writing one chunk per send over a quiet connection is read."""
    out = []
    for frame in frames:
        out.append(body.feed(frame))
        if body.error is not None:
            raise body.error
    return b"".join(out)


def test_one_tiny_chunk_per_read_counts_toward_the_chunk_bound():
    frames = [chunk(b"x")] * (FREE_CHUNKS + 1)
    with pytest.raises(BodyError, match="chunks"):
        feed_each(ChunkedBody(MIN_AVERAGE_CHUNK), frames)
    assert feed_each(ChunkedBody(), frames) == b"x" * (FREE_CHUNKS + 1)  # a relay: no bound


@pytest.mark.parametrize("per_read", [False, True])
def test_the_chunk_bound_is_exact_at_its_threshold(per_read):
    m = MIN_AVERAGE_CHUNK

    def read(frames: list[bytes]) -> bytes:
        body = ChunkedBody(m)
        if per_read:
            return feed_each(body, frames + [b"0\r\n\r\n"])
        out = body.feed(b"".join(frames) + b"0\r\n\r\n")
        if body.error is not None:
            raise body.error
        assert body.done
        return out

    # The free chunks alone, however tiny: no bound yet.
    assert len(read([chunk(b"x")] * FREE_CHUNKS)) == FREE_CHUNKS
    # One past them, averaging exactly the minimum: accepted; one byte short: refused.
    n = FREE_CHUNKS + 1
    exact = [chunk(b"y" * (n * m - FREE_CHUNKS))] + [chunk(b"x")] * FREE_CHUNKS
    assert len(read(exact)) == n * m
    short = [chunk(b"y" * (n * m - FREE_CHUNKS - 1))] + [chunk(b"x")] * FREE_CHUNKS
    with pytest.raises(BodyError, match="chunks"):
        read(short)


async def test_a_body_of_exactly_the_bound_is_read():
    async def receive_of(body: bytes):
        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}
        return receive

    assert await read_body(await receive_of(b"z" * 100), 100) == b"z" * 100
    with pytest.raises(BodyTooLarge):
        await read_body(await receive_of(b"z" * 101), 100)


@pytest.mark.parametrize("length,status", [(1000, 200), (1001, 413)])
async def test_a_declared_length_of_exactly_max_body_bytes_is_served(wire, length, status):
    raw = await answer(wire, echo,
                       b"POST /v1/x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                       b"Content-Length: %d\r\n\r\n" % length + b"b" * length, max_body_bytes=1000)
    assert raw.startswith(b"HTTP/1.1 %d" % status), raw[:80]
    if status == 200:
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["n"] == length


async def test_a_head_over_the_bound_without_any_crlf_is_414(wire):
    raw = await answer(wire, echo, b"GET /v1/" + b"a" * (Settings().max_head + 100))  # no CRLF
    assert raw.startswith(b"HTTP/1.1 414"), raw[:80]


def test_a_target_of_exactly_max_target_is_accepted():
    target = b"/" + b"t" * (MAX_TARGET - 1)
    assert parse_head(b"GET " + target + b" HTTP/1.1\r\nHost: x").target == target
    with pytest.raises(BadRequest) as e:
        parse_head(b"GET " + target + b"t HTTP/1.1\r\nHost: x")
    assert e.value.status == 414


def test_an_absolute_target_without_a_path_keeps_its_query():
    assert parse_head(b"GET http://host?q HTTP/1.1\r\nHost: host").target == b"/?q"
    assert parse_head(b"GET http://host?a=1&b HTTP/1.1\r\nHost: host").target == b"/?a=1&b"
    assert parse_head(b"GET http://host HTTP/1.1\r\nHost: host").target == b"/"


async def test_an_absolute_target_without_a_path_keeps_its_query_on_the_wire(wire):
    raw = await answer(wire, echo, b"GET http://hub?k=v HTTP/1.1\r\nHost: hub\r\n"
                                   b"Connection: close\r\n\r\n")
    got = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert (got["path"], got["query"]) == ("/", "k=v")
