"""The upstream's own request and response heads (appliance/client/upstream.py with h1client.py)
against raw trio servers that answer canned bytes: every framing a peer may choose, a
short answer handed over whole, the connection kept or closed as the peer said."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from appliance.client.upstream import Pool, UpstreamError


async def _canned(stream, *, answers: list[bytes], seen: list[bytes]):
    """Read one request head (and its small body), send the next canned answer; again."""
    buf = b""
    for answer in answers:
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += await stream.receive_some(65536)
        seen.append(head + b"\r\n\r\n" + rest[:length])
        buf = rest[length:]
        if answer == b"CLOSE":
            await stream.aclose()
            return
        if answer.startswith(b"THEN-CLOSE:"):  # the answer, then the end of the connection
            await stream.send_all(answer[len(b"THEN-CLOSE:"):])
            await stream.aclose()
            return
        await stream.send_all(answer)
    await trio.sleep_forever()


async def _start(nursery, answers: list[bytes]):
    seen: list[bytes] = []
    listeners = await nursery.start(partial(trio.serve_tcp, partial(
        _canned, answers=answers, seen=seen), 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1/x?y=1", seen


async def _one(url: str, pool: Pool, method: str = "POST") -> tuple[int, dict, bytes]:
    resp = await pool.request(method, url, [(b"x-request-id", b"r1")], b'{"a":1}', 5)
    try:
        return resp.status_code, resp.headers, await resp.read()
    finally:
        await resp.aclose()


async def _twice(answer: bytes) -> tuple[list[tuple[bytes, int]], list[bytes]]:
    """Two requests on one pool to a peer that answers `answer` to each: each body with the
    pool's idle connections after it, and what the peer read."""
    async with trio.open_nursery() as nursery:
        url, seen = await _start(nursery, [answer, answer])
        pool = Pool()
        got = []
        for _ in range(2):
            got.append(((await _one(url, pool))[2], pool.idle_count()))
        nursery.cancel_scope.cancel()
    return got, seen


async def test_a_short_answer_is_whole_and_its_connection_serves_the_next_request():
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
    async with trio.open_nursery() as nursery:
        url, seen = await _start(nursery, [ok, ok])
        pool = Pool()
        for _ in range(2):
            resp = await pool.request("POST", url, [(b"x-request-id", b"r1")], b'{"a":1}', 5)
            assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
            assert resp.whole() == b"{}"
            assert resp.released and pool.idle_count() == 1
        assert len(seen) == 2  # one connection, both requests
        assert seen[0].startswith(b"POST /v1/x?y=1 HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"\r\nx-request-id: r1\r\ncontent-length: 7\r\n\r\n{\"a\":1}" in seen[0]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("answer,body", [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
     b"abcde"),
    # a 100 Continue first, then the answer
    (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nxyz", b"xyz"),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
])
async def test_framings_read_the_same_body_and_keep_the_connection(answer, body):
    got, seen = await _twice(answer)
    assert got == [(body, 1)] * 2 and len(seen) == 2  # one connection, both requests


async def test_a_close_delimited_answer_is_read_to_the_end_and_its_connection_closed():
    async with trio.open_nursery() as nursery:
        url, seen = await _start(nursery, [b"THEN-CLOSE:HTTP/1.1 200 OK\r\n\r\nall of it"])
        pool = Pool()
        resp = await pool.request("POST", url, [], b"{}", 5)
        assert resp.whole() is None  # no length: not whole, whatever came
        with trio.fail_after(5):
            assert await resp.read() == b"all of it"
        await resp.aclose()
        assert pool.idle_count() == 0
        nursery.cancel_scope.cancel()


async def test_connection_close_is_honoured():
    got, _ = await _twice(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\nconnection: close\r\n\r\nz")
    assert got == [(b"z", 0)] * 2


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    b"SSH-2.0-OpenSSH\r\n\r\n",
])
async def test_a_broken_head_is_an_upstream_error_naming_it(answer):
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, [answer])
        pool = Pool()
        with pytest.raises(UpstreamError, match="sent a broken response") as e:
            await pool.request("POST", url, [], b"{}", 5)
        assert e.value.before_response
        assert pool.idle_count() == 0
        nursery.cancel_scope.cancel()


async def test_a_peer_that_closes_before_answering():
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, [b"CLOSE"])
        with pytest.raises(UpstreamError, match="closed the connection before answering"):
            await Pool().request("POST", url, [], b"{}", 5)
        nursery.cancel_scope.cancel()
