"""The upstream's request heads and response heads (appliance/h1/parse.py), against h11."""

from __future__ import annotations

import h11
import pytest

from appliance.h1.parse import MAX_HEAD, BrokenResponse, encode_request, parse_response_head
from appliance.h1.state import CHUNKED, SIZED, UNTIL_CLOSE


def test_a_request_head_reads_back_through_h11_as_sent():
    head = encode_request("POST", "/v1/chat/completions?x=1",
                          [(b"host", b"node:8080"), (b"authorization", b"Bearer t"),
                           (b"x-request-id", b"abc")], 5)
    server = h11.Connection(h11.SERVER)
    server.receive_data(head + b"hello")
    req = server.next_event()
    assert isinstance(req, h11.Request)
    assert (req.method, req.target) == (b"POST", b"/v1/chat/completions?x=1")
    assert list(req.headers) == [(b"host", b"node:8080"), (b"authorization", b"Bearer t"),
                                 (b"x-request-id", b"abc"), (b"content-length", b"5")]
    assert server.next_event() == h11.Data(data=b"hello")
    assert isinstance(server.next_event(), h11.EndOfMessage)


@pytest.mark.parametrize("headers,target", [
    ([(b"x-a", b"v\r\ninjected: 1")], "/"),
    ([(b"x-a", b"v\nx")], "/"),
    ([(b"x-a", b"v\x00")], "/"),
    ([(b"x a", b"v")], "/"),
    ([(b"x-a:", b"v")], "/"),
    ([], "/a b"),
    ([], "/a\r\nx"),
])
def test_a_header_split_is_refused_not_sent(headers, target):
    with pytest.raises(ValueError):
        encode_request("POST", target, headers, 0)


def _parse(raw: bytes, head_request: bool = False):
    got = parse_response_head(raw, head_request)
    assert got is not None
    return got


def test_a_sized_answer_and_the_bytes_after_its_head():
    raw = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\ncontent-length: 7\r\n"
           b"X-Request-Id: r1\r\n\r\n{\"a\":1}")
    head, used = _parse(raw)
    assert raw[used:] == b'{"a":1}'
    assert (head.status_code, head.framing, head.length, head.keep_alive) == (200, SIZED, 7,
                                                                             True)
    assert head.headers == {"content-type": "application/json", "content-length": "7",
                            "x-request-id": "r1"}
    assert head.raw_headers[0] == (b"content-type", b"application/json")


@pytest.mark.parametrize("raw,framing,length,keep", [
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", CHUNKED, 0, True),
    # Transfer-Encoding wins over Content-Length (RFC 9112 6.3)
    (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n", CHUNKED, 0,
     True),
    (b"HTTP/1.1 200 OK\r\n\r\n", UNTIL_CLOSE, 0, False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n", SIZED, 2, False),
    (b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\n", SIZED, 2, False),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n", SIZED, 2, False),
    (b"HTTP/1.1 204 No Content\r\n\r\n", SIZED, 0, True),
    (b"HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n", SIZED, 0, True),
    (b"HTTP/1.1 100 Continue\r\n\r\n", SIZED, 0, True),
    (b"HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\n", SIZED, 3, True),
    (b"HTTP/1.1 503\r\ncontent-length: 0\r\n\r\n", SIZED, 0, True),
])
def test_the_framing_is_what_h11_decides(raw, framing, length, keep):
    head, used = _parse(raw)
    assert used == len(raw)
    assert (head.framing, head.length, head.keep_alive) == (framing, length, keep)
    # h11, as the client that sent a GET, frames the same body the same way
    c = h11.Connection(h11.CLIENT)
    c.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    c.send(h11.EndOfMessage())
    c.receive_data(raw + b"xyz")
    ev = c.next_event()
    assert ev.status_code == head.status_code
    if head.status_code >= 200 and framing == SIZED:
        body = b""
        while True:
            ev = c.next_event()
            if isinstance(ev, h11.Data):
                body += ev.data
            else:
                break
        assert isinstance(ev, h11.EndOfMessage)
        assert len(body) == length
        assert c.their_state is (h11.DONE if keep else h11.MUST_CLOSE)


def test_a_head_request_has_no_body_whatever_it_says():
    head, _ = _parse(b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n", head_request=True)
    assert (head.framing, head.length) == (SIZED, 0)


def test_an_incomplete_head_waits_and_a_huge_one_is_broken():
    assert parse_response_head(b"HTTP/1.1 200 OK\r\ncontent-le") is None
    with pytest.raises(BrokenResponse):
        parse_response_head(b"HTTP/1.1 200 OK\r\nx: " + b"a" * (MAX_HEAD + 10))


@pytest.mark.parametrize("raw", [
    b"HTTP/2 200 OK\r\n\r\n",
    b"HTTP/1.1 20 OK\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx y: z\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 0x10\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
    b"garbage\r\n\r\n",
])
def test_broken_heads_are_refused(raw):
    with pytest.raises(BrokenResponse):
        parse_response_head(raw)
