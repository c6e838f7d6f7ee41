"""The relay's fast path (appliance/server/fastio.py): direct chunk writes, lean reads."""

from __future__ import annotations

import socket

import h11
import pytest
import trio
from h11io import response

from appliance.http.asgi import serve
from appliance.server.fastio import DirectBody, recv_some


def _app(opened: list, chunks: list[bytes], sized: bool = False):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        headers = [(b"content-type", b"text/event-stream")]
        if sized:
            headers.append((b"content-length", str(sum(map(len, chunks))).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        direct = DirectBody.open(scope)
        opened.append(direct is not None)
        for c in chunks:
            if direct is None or not await direct.write(c):
                direct = None
                await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    return app


async def _start(nursery, app) -> tuple[str, int]:
    stop = trio.Event()
    host, port = await nursery.start(lambda task_status: serve(app, "127.0.0.1:0", "sim", shutdown_trigger=stop.wait,
                                                               drain_seconds=0.1, task_status=task_status))
    return host, port


async def _exchange(stream, conn: h11.Connection) -> tuple[int, bytes]:
    """One GET on `stream`; (status, body) as h11 reads them (it rejects broken framing)."""
    conn_req = h11.Request(method="GET", target="/", headers=[("host", "x")])
    await stream.send_all(conn.send(conn_req) + conn.send(h11.EndOfMessage()))
    status, _, body = await response(stream, conn)
    return status, body


async def test_direct_chunks_are_valid_chunked_framing_and_the_connection_stays_usable():
    opened: list[bool] = []
    chunks = [b"data: one\n\n", b"data: two\n\n", b"x" * 70000, b"data: [DONE]\n\n"]
    async with trio.open_nursery() as nursery:
        host, port = await _start(nursery, _app(opened, chunks))
        stream = await trio.open_tcp_stream(host, port)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(2):  # keep-alive: the second request on the same connection
            status, body = await _exchange(stream, conn)
            assert (status, body) == (200, b"".join(chunks))
            conn.start_next_cycle()
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert opened == [True, True]


@pytest.mark.parametrize("case", ["http/1.0", "sized"])
async def test_no_fast_path_where_the_body_is_not_chunked(case):
    opened: list[bool] = []
    chunks = [b"a", b"bc"]
    async with trio.open_nursery() as nursery:
        host, port = await _start(nursery, _app(opened, chunks, sized=case == "sized"))
        stream = await trio.open_tcp_stream(host, port)
        if case == "http/1.0":  # h11 sends only 1.1: by hand, the answer delimited by the close
            await stream.send_all(b"GET / HTTP/1.0\r\nhost: x\r\n\r\n")
            raw = b""
            while data := await stream.receive_some(65536):
                raw += data
            head, _, body = raw.partition(b"\r\n\r\n")
            assert (head.split()[1], body) == (b"200", b"abc")
        else:
            status, body = await _exchange(stream, h11.Connection(h11.CLIENT))
            assert (status, body) == (200, b"abc")
        await stream.aclose()
        nursery.cancel_scope.cancel()
    assert opened == [False]


async def test_a_client_gone_mid_stream_turns_writes_false_and_the_app_ends_through_asgi():
    results: list[bool] = []
    done = trio.Event()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        direct = DirectBody.open(scope)
        assert direct is not None
        try:
            for _ in range(2000):  # 128 MB: far past any socket buffer once the client is gone
                ok = await direct.write(b"y" * 65536)
                if not ok:
                    results.append(ok)
                    assert not await direct.write(b"more")  # stays broken
                    await send({"type": "http.response.body", "body": b"z", "more_body": True})
                    break
                await trio.sleep(0)
        finally:
            done.set()

    async with trio.open_nursery() as nursery:
        host, port = await _start(nursery, app)
        stream = await trio.open_tcp_stream(host, port)
        await stream.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await stream.receive_some(1024)
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        await stream.aclose()
        with trio.fail_after(20):
            await done.wait()
        nursery.cancel_scope.cancel()
    assert results == [False]


async def test_recv_some_reads_ends_and_honours_deadlines(autojump_clock):
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    with a, b:
        with trio.move_on_after(5) as cs:
            await recv_some(a, 100)  # nothing sent: waits until the deadline
        assert cs.cancelled_caught
        b.send(b"hello")
        assert await recv_some(a, 100) == b"hello"
        b.shutdown(socket.SHUT_WR)
        assert await recv_some(a, 100) == b""
