"""The listener grammar of issue 22 (item 5) and the HTTP mutants it listed (item 7), each a
test that fails on its mutant -- on plain and TLS listeners (`wire`), and on the sans-I/O
parts (appliance/h1/) directly."""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import trio

from appliance.bounds import PATH_ECHO
from appliance.h1.body import FREE_CHUNKS, MAX_LINE, BodyError, ChunkedBody
from appliance.h1.parse import (
    MAX_HEAD,
    MAX_HEADERS,
    BadRequest,
    BrokenResponse,
    parse_head,
    parse_response_head,
)
from appliance.h1.state import SIZED
from appliance.server.limits import LiveLimits
from appliance.server.serve import Settings, listening_socket, serve_sockets
from tests.harness.h11io import until_closed
from tests.server.test_h1 import answer, echo, running

# --- request heads (sans-I/O) ---------------------------------------------------------


def test_content_length_zero_with_chunked_is_refused():
    # h11 accepts this head too, so only this test sees a `length > 0` mutant.
    with pytest.raises(BadRequest) as e:
        parse_head(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                   b"Transfer-Encoding: chunked")
    assert e.value.status == 400


def test_the_header_count_bound_is_exact():
    def head(n: int) -> bytes:  # n fields, Host among them
        return b"GET / HTTP/1.1\r\nHost: x" + b"".join(b"\r\nX-%d: v" % i for i in range(n - 1))

    assert len(parse_head(head(MAX_HEADERS)).headers) == MAX_HEADERS
    with pytest.raises(BadRequest) as e:
        parse_head(head(MAX_HEADERS + 1))
    assert e.value.status == 431


def test_absolute_form_minor_versions_and_long_targets():
    h = parse_head(b"GET http://hub:8080/v1/models?x=1 HTTP/1.1\r\nHost: hub")
    assert h.target == b"/v1/models?x=1"
    assert parse_head(b"GET HTTPS://hub HTTP/1.1\r\nHost: hub").target == b"/"
    assert parse_head(b"GET / HTTP/1.2\r\nHost: x").version == "1.1"
    assert parse_head(b"GET / HTTP/1.9\r\nHost: x").keep_alive
    with pytest.raises(BadRequest) as e:
        parse_head(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x")
    assert e.value.status == 414


# --- chunked bodies (sans-I/O) --------------------------------------------------------


def read_all(body: ChunkedBody, data: bytes) -> bytes:
    """All of `data` as the server reads it: a break after some payload raises too."""
    out = body.feed(data)
    if body.error is not None:
        raise body.error
    return out


@pytest.mark.parametrize("bad", [b"a\x00b", b"a\x7fb", b"a\rb"])
def test_nul_del_and_cr_in_a_trailer_value_are_refused(bad):
    with pytest.raises(BodyError, match="trailer"):
        read_all(ChunkedBody(), b"1\r\nx\r\n0\r\nX-T: " + bad + b"\r\n\r\n")


def test_line_bounds_hold_when_the_crlf_comes_in_the_same_read():
    long_ext = b"1;" + b"e" * (MAX_LINE + 100) + b"\r\nx\r\n0\r\n\r\n"
    with pytest.raises(BodyError):
        read_all(ChunkedBody(), long_ext)
    long_trailer = b"0\r\nX-T: " + b"v" * (MAX_LINE + 100) + b"\r\n\r\n"
    with pytest.raises(BodyError):
        read_all(ChunkedBody(), long_trailer)


def test_white_space_before_an_extension_is_refused_as_h11_does():
    with pytest.raises(BodyError):
        read_all(ChunkedBody(), b"2 ; a=b\r\nxx\r\n0\r\n\r\n")


def test_many_tiny_chunks_are_refused_past_the_free_ones():
    tiny = b"1\r\nx\r\n" * (FREE_CHUNKS + 1)
    assert read_all(ChunkedBody(), tiny) == b"x" * (FREE_CHUNKS + 1)  # no bound: a relay
    with pytest.raises(BodyError, match="chunks"):
        read_all(ChunkedBody(1024), tiny)
    big = (b"400\r\n" + b"y" * 1024 + b"\r\n") * (FREE_CHUNKS + 1)
    assert len(read_all(ChunkedBody(1024), big)) == 1024 * (FREE_CHUNKS + 1)


# --- response heads (the client, sans-I/O) --------------------------------------------


def test_a_complete_response_head_over_the_bound_is_refused():
    head = b"HTTP/1.1 200 OK\r\nX-Big: " + b"v" * (MAX_HEAD + 10) + b"\r\n\r\n"
    with pytest.raises(BrokenResponse, match="over"):
        parse_response_head(head)


def test_1xx_heads_carry_no_body():
    got = parse_response_head(b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\nHTTP/1.1 200")
    assert got is not None
    head, used = got
    assert head.status_code == 103 and head.framing == SIZED and head.length == 0
    got = parse_response_head(b"HTTP/1.1 100 Continue\r\ncontent-length: 5\r\n\r\n")
    assert got is not None and got[0].length == 0


# --- on the listener, plain and TLS ---------------------------------------------------


async def test_absolute_form_and_http_1_2_are_served(wire):
    raw = await answer(wire, echo, b"GET http://hub/v1/x?y=1 HTTP/1.2\r\nHost: hub\r\n"
                                   b"Connection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 200")
    got = json.loads(raw.partition(b"\r\n\r\n")[2])
    assert (got["path"], got["query"], got["version"]) == ("/v1/x", "y=1", "1.1")


@pytest.mark.parametrize("n", [9000, 20000])
async def test_a_long_target_is_414_and_not_echoed_whole(wire, n):
    raw = await answer(wire, echo, b"GET /v1/" + b"a" * n + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 414"), raw[:100]
    assert len(raw) < 1000


async def test_an_echoed_path_is_cut(wire):
    from appliance.config import SimConfig
    from appliance.sim.server import make_sim_app  # an app whose 404 names the path

    raw = await answer(wire, make_sim_app(SimConfig()),
                       b"GET /" + b"p" * 5000 + b" HTTP/1.1\r\nHost: x\r\n"
                       b"Connection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 404")
    message = json.loads(raw.partition(b"\r\n\r\n")[2])["error"]
    assert len(message) < PATH_ECHO + 100 and "..." in message


async def test_a_declared_length_over_the_bound_is_413_at_once_without_100_continue(
        wire, autojump_clock):
    async with running(wire, echo, max_body_bytes=1000) as (host, port, _):
        stream = await wire.connect(host, port)
        t0 = trio.current_time()
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Expect: 100-continue\r\nContent-Length: 999999999\r\n\r\n")
        raw = await until_closed(stream)
        assert trio.current_time() - t0 < 1  # no body waited for
    assert raw.startswith(b"HTTP/1.1 413") and b"100 Continue" not in raw
    assert json.loads(raw.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_too_large"


async def test_one_byte_chunks_are_refused(wire):
    raw = await answer(wire, echo,
                       b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                       + b"1\r\nx\r\n" * (FREE_CHUNKS + 10) + b"0\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400") and b"chunks" in raw


async def test_no_100_continue_once_the_body_is_here(wire):
    raw = await answer(wire, echo, b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                   b"Content-Length: 5\r\nConnection: close\r\n\r\nhello")
    assert raw.startswith(b"HTTP/1.1 200") and b"100 Continue" not in raw


async def test_an_unread_body_already_here_does_not_close_the_connection(wire):
    async def early(scope, receive, send):  # answers without reading the body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": scope["path"].encode()})

    raw = await answer(wire, early,
                       b"POST /one HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                       b"POST /two HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                       b"\r\n3\r\nabc\r\n0\r\n\r\n"
                       b"GET /three HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert raw.count(b"HTTP/1.1 200") == 3 and raw.endswith(b"/three")


async def test_the_keep_alive_request_bound_closes_after_the_last(wire):
    lsock = listening_socket("127.0.0.1:0")
    port = lsock.getsockname()[1]
    tls = None
    if wire.tls:
        from appliance.server.serve import tls_context
        tls = tls_context(wire.cert, wire.key)
    async with trio.open_nursery() as n:
        await n.start(partial(serve_sockets, echo, [lsock], tls, LiveLimits(),
                              Settings(max_requests=3), shutdown_trigger=trio.sleep_forever))
        stream = await wire.connect("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 5)
        raw = await until_closed(stream)
        n.cancel_scope.cancel()
    assert raw.count(b"HTTP/1.1 200") == 3  # the fourth and fifth are not served
    assert raw.count(b"connection: close") == 1 and raw.rfind(b"connection: close") > raw.rfind(
        b"HTTP/1.1 200")


def test_a_socket_is_left_for_the_os_to_pick():  # (listening_socket binds port 0)
    s = listening_socket("127.0.0.1:0")
    assert s.getsockname()[1] > 0 and s.type == socket.SOCK_STREAM
    s.close()


# The inputs on which the plain and the TLS path of one listener disagreed (issue 22, when
# hypercorn served TLS): one connection serves both now, and each gets one answer.
DISAGREED = [
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\r\n c\r\n\r\n", 400),  # obs-fold
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-A: b\x7fc\r\n\r\n", 400),  # DEL in a value
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(128))
     + b"\r\n", 431),  # 129 fields
    (b"GET / HTTP/1.1\nHost: x\n\n", 400),  # LF-only head (no CRLF CRLF: cut at the deadline)
    (b"GET / HTTP/1.2\r\nHost: x\r\nConnection: close\r\n\r\n", 200),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\nab", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2 \r\nab\r\n0\r\n\r\n",
     400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"0" * 16 + b"2\r\nab\r\n0\r\n\r\n", 400),  # 17 hex digits
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2;" + b"e" * 5000
     + b"\r\nab\r\n0\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2 ; a=b\r\nab\r\n"
     b"0\r\n\r\n", 400),
]


@pytest.mark.parametrize("data,status", DISAGREED)
async def test_plain_and_tls_give_one_answer(wire_pki, data, status, autojump_clock):
    from tests.harness.wire import Wire

    answers = []
    for wire in (Wire("plain"), Wire("tls", wire_pki)):
        async with running(wire, echo, header_read_seconds=5) as (host, port, _):
            stream = await wire.connect(host, port)
            await stream.send_all(data)
            answers.append((await until_closed(stream))[:12])
    expected = b"HTTP/1.1 %d" % status if b"\n\n" not in data else b"HTTP/1.1 408"
    assert answers[0] == answers[1] == expected


async def test_a_stalled_tls_handshake_is_cut_at_the_head_deadline(wire_pki, autojump_clock):
    from tests.harness.wire import Wire

    async with running(Wire("tls", wire_pki), echo, header_read_seconds=7) as (host, port, _):
        tcp = await trio.open_tcp_stream(host, port)  # never says hello
        t0 = trio.current_time()
        assert await until_closed(tcp) == b""
        assert trio.current_time() - t0 == pytest.approx(7, abs=0.5)
