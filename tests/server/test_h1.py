"""The HTTP/1.1 connection of every listener (appliance/server/connection.py), spoken to over
real loopback sockets, each test on a plain and a TLS listener (`wire`, tests/harness/wire.py):
framing and refusals, keep-alive, pipelining, 100-continue, HEAD, HTTP/1.0, the
disconnect reaching the app, deadlines, bounds and the drain."""

from __future__ import annotations

import json
import re
import socket
from contextlib import asynccontextmanager
from functools import partial

import h11
import pytest
import trio

from appliance.http.asgi import read_body
from appliance.http.stream import HANGUP, cancel_on_disconnect
from appliance.server.limits import Limits
from appliance.server.serve import serve
from tests.harness.h11io import response, until_closed
from tests.harness.wire import Wire


async def echo(scope, receive, send):
    """Answers what it read: method, path, query, body length, and the body itself."""
    body = await read_body(receive, 1 << 20)
    out = json.dumps({"method": scope["method"], "path": scope["path"],
                      "query": scope["query_string"].decode(), "n": len(body),
                      "body": body.decode("latin-1"), "version": scope["http_version"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})


async def streamer(scope, receive, send):
    await read_body(receive, 1 << 20)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for part in (b"one ", b"two ", b"three"):
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@asynccontextmanager
async def running(wire, app, drain: float = 5.0, **limits):
    stop = trio.Event()
    async with trio.open_nursery() as n:
        host, port = await n.start(partial(serve, app, "127.0.0.1:0", "fake",
                                           shutdown_trigger=stop.wait, drain_seconds=drain,
                                           limits=Limits(**limits), **wire.serve_kwargs))
        try:
            yield host, port, stop
        finally:
            n.cancel_scope.cancel()


async def exchange(wire, host: str, port: int, data: bytes) -> bytes:
    """`data` sent on a new connection, and all the server says on it until it closes."""
    stream = await wire.connect(host, port)
    await stream.send_all(data)
    return await until_closed(stream)


async def kept_alive(wire, host: str, port: int):
    """A new connection whose first GET was answered 200, kept alive."""
    stream = await wire.connect(host, port)
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    assert (await response(stream, conn))[0] == 200
    return stream


async def answer(wire, app, data: bytes, **limits) -> bytes:
    """What a listener serving `app` says to `data` on one connection, until it closes."""
    async with running(wire, app, **limits) as (host, port, _):
        return await exchange(wire, host, port, data)


async def test_keep_alive_sized_and_chunked_answers_on_one_connection(wire):
    async with running(wire, echo) as (host, port, _):
        stream = await wire.connect(host, port)
        conn = h11.Connection(h11.CLIENT)
        for i, body in enumerate((b"", b"x" * 100_000, b"hello")):
            headers = [("host", "x")]
            if i == 2:  # a chunked request body
                headers.append(("transfer-encoding", "chunked"))
            else:
                headers.append(("content-length", str(len(body))))
            data = conn.send(h11.Request(method="POST", target=f"/p%20q?a={i}",
                                         headers=headers))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(data)
            status, headers_got, got = await response(stream, conn)
            answer = json.loads(got)
            assert (status, answer["n"], answer["path"], answer["query"]) == (
                200, len(body), "/p q", f"a={i}")
            assert answer["body"] == body.decode()
            assert "date" in headers_got and headers_got["content-length"] == str(len(got))
            conn.start_next_cycle()
    async with running(wire, streamer) as (host, port, _):
        stream = await wire.connect(host, port)
        conn = h11.Connection(h11.CLIENT)
        for _ in range(2):
            await stream.send_all(conn.send(h11.Request(method="GET", target="/",
                                                        headers=[("host", "x")]))
                                  + conn.send(h11.EndOfMessage()))
            status, headers_got, got = await response(stream, conn)
            assert (status, got, headers_got["transfer-encoding"]) == (200, b"one two three",
                                                                       "chunked")
            conn.start_next_cycle()


async def test_pipelined_requests_are_answered_in_order(wire):
    async with running(wire, echo) as (host, port, _):
        stream = await wire.connect(host, port)
        reqs = b"".join(b"POST /%d HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n%d" % (i, i)
                        for i in range(5))
        await stream.send_all(reqs + b"GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = await until_closed(stream)
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        paths = []
        conn.receive_data(raw)
        conn.receive_data(b"")
        while True:
            ev = conn.next_event()
            if isinstance(ev, h11.Data):
                paths.append(json.loads(ev.data)["path"])
            elif isinstance(ev, h11.EndOfMessage):
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    break
                conn.start_next_cycle()
                conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
                conn.send(h11.EndOfMessage())
            elif ev is h11.NEED_DATA or isinstance(ev, h11.ConnectionClosed):
                break
    assert paths == ["/0", "/1", "/2", "/3", "/4", "/last"]
    assert raw.count(b"HTTP/1.1 200") == 6 and raw.count(b"connection: close") == 1


async def test_head_http10_and_expect_continue(wire):
    async with running(wire, echo) as (host, port, _):
        raw = await exchange(wire, host, port,
                             b"HEAD / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: " in head and body == b""
        # HTTP/1.0: answered, then closed (no keep-alive), streamed bodies end with the close.
        raw = await exchange(wire, host, port, b"POST /old HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi")
        assert raw.startswith(b"HTTP/1.1 200") and b"connection: close" in raw
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["version"] == "1.0"
        # Expect: 100-continue: the interim answer comes before the body is sent.
        stream = await wire.connect(host, port)
        await stream.send_all(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                              b"Expect: 100-continue\r\n\r\n")
        with trio.fail_after(10):
            interim = await stream.receive_some(65536)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        await stream.send_all(b"abc")
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"),
                                                                  ("content-length", "3")]))
        status, _, body = await response(stream, conn)
        assert status == 200 and json.loads(body)["n"] == 3
    async with running(wire, streamer) as (host, port, _):
        raw = await exchange(wire, host, port, b"GET / HTTP/1.0\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert body == b"one two three" and b"transfer-encoding" not in head


REFUSED = [
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
     b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"Transfer-Encoding"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400,
     b"Content-Length"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400, b"Content-Length"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n", 400, b"obs-fold"),
    (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400, b"header"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, b"chunked"),
    (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400, b"HTTP/1.0"),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505, b"version"),
    (b"GET / HTTP/1.1\r\n\r\n", 400, b"Host"),
    (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"request line"),
    (b"\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n", 400, b"request line"),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200))
     + b"\r\n", 431, b"header fields"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"v" * 20000 + b"\r\n\r\n", 431, b"too large"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nxx\r\n0\r\n\r\n",
     400, b"chunk size"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nxxx\r\n0\r\n\r\n",
     400, b"CRLF"),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
     400, b"trailer"),
]


@pytest.mark.parametrize("data,status,why", REFUSED)
async def test_refusals_are_answered_in_the_api_shape_and_the_connection_closed(wire, data, status,
                                                                                 why):
    raw = await answer(wire, echo, data)
    assert raw.startswith(b"HTTP/1.1 %d" % status), raw[:300]
    assert len(re.findall(rb"HTTP/1.1 \d\d\d ", raw)) == 1, raw[:300]  # nothing behind it served
    assert b"connection: close" in raw and why in raw
    assert "error" in json.loads(raw.partition(b"\r\n\r\n")[2])


async def test_head_deadline_then_keep_alive_bound(wire, autojump_clock):
    async with running(wire, echo, header_read_seconds=10) as (host, port, _):
        partial_head = await wire.connect(host, port)
        await partial_head.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        silent = await wire.connect(host, port)
        t0 = trio.current_time()
        raw = await until_closed(partial_head)
        assert raw.startswith(b"HTTP/1.1 408") and b"request_timeout" in raw
        assert trio.current_time() - t0 == pytest.approx(10, abs=0.5)
        assert await until_closed(silent) == b""  # no head at all: just closed
        # Kept alive: idle for up to hypercorn's keep_alive_timeout (75 s), then closed.
        stream = await kept_alive(wire, host, port)
        t0 = trio.current_time()
        await trio.sleep(60)
        await stream.send_all(b"GET / HTTP/1.1\r\n")  # the next head starts its own deadline
        raw = await until_closed(stream)
        assert raw.startswith(b"HTTP/1.1 408")
        assert trio.current_time() - t0 == pytest.approx(70, abs=0.5)
        stream = await kept_alive(wire, host, port)
        t0 = trio.current_time()
        assert await until_closed(stream) == b""
        assert trio.current_time() - t0 == pytest.approx(75, abs=0.5)


async def test_body_deadline_and_budget_are_answered_408_and_503(wire, autojump_clock):
    async with running(wire, echo, body_read_seconds=30, max_buffered_bytes=1000) as (host, port, _):
        stream = await wire.connect(host, port)
        await stream.send_all(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        t0 = trio.current_time()
        raw = await until_closed(stream)
        assert raw.startswith(b"HTTP/1.1 408") and trio.current_time() - t0 == pytest.approx(30,
                                                                                          abs=1)
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        raw = await exchange(wire, host, port,
                             b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n"
                             + b"y" * 2000)
        assert raw.startswith(b"HTTP/1.1 503") and b"retry-after: 2" in raw
        assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "busy"


async def test_408_and_busy_on_v1_messages_are_in_anthropics_shape(wire, autojump_clock):
    """An Anthropic client reads its own error shape (it got OpenAI's before)."""
    async with running(wire, echo, body_read_seconds=30, max_buffered_bytes=1000) as (host, port, _):
        raw = await exchange(wire, host, port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
                                               b"Content-Length: 10\r\n\r\nabc")
        assert raw.startswith(b"HTTP/1.1 408")
        body = json.loads(raw.partition(b"\r\n\r\n")[2])
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        raw = await exchange(wire, host, port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n"
                                               b"Content-Length: 2000\r\n\r\n" + b"y" * 2000)
        assert raw.startswith(b"HTTP/1.1 503") and b"retry-after: 2" in raw
        body = json.loads(raw.partition(b"\r\n\r\n")[2])
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"


async def test_a_client_gone_mid_stream_is_told_to_the_app(wire, autojump_clock):
    seen: list[str] = []
    done = trio.Event()

    async def app(scope, receive, send):
        await read_body(receive, 1000)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            async with cancel_on_disconnect(receive) as gone:
                while True:
                    await send({"type": "http.response.body", "body": b"tick\n",
                                "more_body": True})
                    await trio.sleep(0.01)
            seen.append("gone" if gone.gone else "ended")
        finally:
            done.set()

    async with running(wire, app) as (host, port, _):
        stream = await wire.connect(host, port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await stream.receive_some(65536)
        await stream.aclose()
        with trio.fail_after(10):
            await done.wait()
    assert seen == ["gone"]


async def test_disconnect_is_said_when_the_answer_ends_and_app_errors_are_500(wire, autojump_clock):
    said: list[str] = []

    async def app(scope, receive, send):
        if scope["path"] == "/boom":
            raise ValueError("a bug")
        await read_body(receive, 10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async with trio.open_nursery() as n:
            async def watch():
                said.append((await receive())["type"])
            n.start_soon(watch)
            await trio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"ok"})

    raw = await answer(wire, app, b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /boom HTTP/1.1\r\nHost: x"
                                  b"\r\n\r\n")
    assert said == ["http.disconnect"]
    assert raw.startswith(b"HTTP/1.1 200") and b"\r\n\r\nokHTTP/1.1 500" in raw


async def test_the_oldest_idle_connection_is_shed_at_the_bound(wire, autojump_clock):
    async with running(wire, echo, max_connections=2) as (host, port, _):
        first = await wire.connect(host, port)
        second = await wire.connect(host, port)
        await trio.sleep(0.2)
        third = await wire.connect(host, port)
        await third.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await until_closed(third)).startswith(b"HTTP/1.1 200")
        assert await until_closed(first) == b""  # shed
        await second.send_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await until_closed(second)).startswith(b"HTTP/1.1 200")


async def test_drain_finishes_the_request_in_flight_and_closes_idle_connections(wire, autojump_clock):
    release = trio.Event()

    async def slow(scope, receive, send):
        await read_body(receive, 10)
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async with running(wire, slow, drain=30) as (host, port, stop):
        idle = await wire.connect(host, port)
        await idle.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"done" in await idle.receive_some(65536)
        busy = await wire.connect(host, port)
        await busy.send_all(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.1)
        stop.set()
        assert await until_closed(idle) == b""  # idle: closed at once
        with pytest.raises(OSError):
            await wire.connect(host, port)  # no longer accepting
        release.set()
        raw = await until_closed(busy)
        assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"done")
        assert b"connection: close" in raw


async def test_a_client_half_close_after_its_request_still_gets_the_answer():
    """Plain only: TLS has no half-close (a TLS client closes whole)."""
    async with running(Wire("plain"), echo) as (host, port, _):
        s = socket.create_connection((host, port))
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        s.setblocking(False)
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(s))
        raw = await until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 200")


async def test_app_heads_are_written_once_and_a_bad_one_is_a_500(wire):
    async def app(scope, receive, send):
        await read_body(receive, 10)
        value = b"a\r\nx-smuggled: 1" if scope["path"] == "/bad" else b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"Content-Length", b"2"), (b"X-Value", value),
                                (b"Transfer-Encoding", b"chunked")]})
        await send({"type": "http.response.body", "body": b"hi"})

    raw = await answer(wire, app, b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /bad HTTP/1.1\r\nHost: x"
                                  b"\r\n\r\n")
    first, _, second = raw.partition(b"hi")
    assert first.count(b"content-length: 2\r\n") == 1 and b"x-value: ok\r\n" in first
    assert b"transfer-encoding" not in first  # the framing is the server's
    assert second.startswith(b"HTTP/1.1 500") and b"smuggled" not in second


async def test_a_head_trickled_byte_by_byte_is_read_whole(wire, autojump_clock):
    async with running(wire, echo) as (host, port, _):
        stream = await wire.connect(host, port)
        wire.sock(stream).setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        data = b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
        for i in range(len(data)):
            await stream.send_all(data[i:i + 1])
            await trio.sleep(0.001)
        raw = await until_closed(stream)
    assert raw.startswith(b"HTTP/1.1 200") and json.loads(raw.partition(b"\r\n\r\n")[2])["n"] == 2


async def test_a_request_pipelined_while_an_answer_streams_is_kept_for_after_it(wire, autojump_clock):
    async def app(scope, receive, send):
        await read_body(receive, 10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        async with cancel_on_disconnect(receive) as gone:  # reads the socket meanwhile
            await send({"type": "http.response.body", "body": scope["path"].encode(),
                        "more_body": True})
            await trio.sleep(0.3)
        assert not gone.gone
        await send({"type": "http.response.body", "body": b"!"})

    async with running(wire, app) as (host, port, _):
        stream = await wire.connect(host, port)
        await stream.send_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(10):
            assert b"/first" in await stream.receive_some(65536)
        for part in (b"GET /sec", b"ond HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"):
            await stream.send_all(part)  # while /first is still streaming
            await trio.sleep(0.05)
        raw = await until_closed(stream)
    assert raw.count(b"HTTP/1.1 200") == 1 and b"/second" in raw and raw.endswith(b"0\r\n\r\n")


async def refuser(scope, receive, send):
    """Answers 401 without reading the body (as the hub refuses a wrong token)."""
    await send({"type": "http.response.start", "status": 401, "headers": []})
    await send({"type": "http.response.body", "body": b"no"})


async def test_an_answer_before_a_body_still_owed_says_close(wire, autojump_clock):
    """A refusal that begins before the body arrived closes the connection: its head says
    so (it said keep-alive, then the connection closed, and the client's next request on it
    got no answer: httpx's "Server disconnected without sending a response")."""
    async with running(wire, refuser) as (host, port, _):
        raw = await exchange(wire, host, port,
                             b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        assert raw.startswith(b"HTTP/1.1 401") and b"connection: close" in raw.lower()
        # The body here whole with its head: skipped, the connection serves the next one.
        raw = await exchange(wire, host, port,
                             b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                             b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
        assert raw.count(b"HTTP/1.1 401") == 2 and raw.lower().count(b"connection: close") == 1


async def test_accepted_connections_send_small_writes_at_once(wire):
    """TCP_NODELAY on every accepted connection (a token is a write): set once on the
    listening socket, which the accepted ones inherit."""
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["extensions"][HANGUP].transport.sock.getsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY))
        await echo(scope, receive, send)

    out = await answer(wire, app, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200") and seen == [1]
