"""The lean server's parser (appliance/h1/parse.py) against h11 as the oracle: it never
accepts what h11 refuses, reads what it accepts the same way, and raises nothing but
BadRequest. Hypothesis builds heads from parts (duplicates, odd white space, obs-fold,
framing headers) and mutates bytes; chunked bodies are split and fed in random pieces."""

from __future__ import annotations

import re

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.h1.body import BodyError, ChunkedBody
from appliance.h1.parse import BadRequest, parse_head

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Mostly valid parts, so that both acceptance and refusal are exercised.
names = st.sampled_from([b"Content-Length", b"Transfer-Encoding", b"Connection", b"Expect",
                         b"X-A", b"x-b", b"Accept", b"Host", b"Bad Name", b"", b"X\x00",
                         b"\tX-Fold"])
values = st.one_of(
    st.sampled_from([b"x", b"chunked", b"Chunked", b"gzip, chunked", b"5", b"05", b"-1", b"1 1",
                     b"close", b"keep-alive, close", b"100-continue", b"", b"  v  ", b"\xff",
                     b"a\rb", b"a\nb", b"a\x00b", b"99999999999999999999", b"a b\tc"]),
    st.binary(max_size=12))
seps = st.sampled_from([b": ", b": ", b":", b":\t", b" : "])
plain = st.tuples(st.sampled_from([b"X-A", b"x-b", b"Accept", b"User-Agent"]), seps,
                  st.sampled_from([b"x", b"a b\tc", b"", b"  v  ", b"\xff"]))
header_lists = st.lists(st.one_of(plain, plain, st.tuples(names, seps, values)), max_size=5)
request_lines = st.one_of(
    st.tuples(st.sampled_from([b"GET", b"POST", b"HEAD", b"get", b"M-SEARCH"]),
              st.sampled_from([b"/", b"/a?b=c", b"*", b"/%20", b"http://h/x", b"/~!$&'()*+,;="]),
              st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2"]))
    .map(lambda t: b" ".join(t)),
    st.tuples(st.sampled_from([b"GET", b"G T", b"", b"GET\t"]),
              st.sampled_from([b"/", b"", b"/\x7f", b"/ /", b"/\x80"]),
              st.sampled_from([b"HTTP/1.1", b"HTTP/1.10", b"http/1.1", b"HTTP/1", b"HTTP/1.1 "]))
    .map(lambda t: b" ".join(t)),
    st.binary(max_size=30))


def h11_head(head: bytes):
    """h11's reading of the same head: (method, target, version, headers), or None."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(head + b"\r\n\r\n")
    try:
        ev = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if not isinstance(ev, h11.Request):
        return None
    # What we read differently on purpose: an absolute-form target as its path (RFC 9112
    # 3.2.2), HTTP/1.x above 1 as HTTP/1.1 (RFC 9110 2.5).
    target = re.sub(rb"^[Hh][Tt][Tt][Pp][Ss]?://[^/?#]+", b"", ev.target)
    if target[:1] != b"/" and target != ev.target:
        target = b"/" + target
    version = ev.http_version.decode()
    if version.startswith("1.") and version not in ("1.0", "1.1"):
        version = "1.1"
    return (ev.method.decode(), target, version, [(k, v) for k, v in ev.headers])


def check(head: bytes) -> None:
    try:
        ours = parse_head(head)
    except BadRequest as e:
        assert e.status in (400, 414, 431, 501, 505)
        return
    theirs = h11_head(head)
    assert theirs is not None, head  # never accept what h11 refuses
    assert (ours.method, ours.target, ours.version, ours.headers) == theirs
    if ours.chunked:
        assert b"chunked" in dict(ours.headers)[b"transfer-encoding"].lower()


@FAST
@given(request_lines, st.sampled_from([b"Host: hub", b"", b"Host: a\r\nHost: b"]), header_lists)
def test_heads_built_from_parts_are_read_as_h11_reads_them_or_refused(line, host, headers):
    fields = ([(b"", b"", host)] if host else []) + headers
    head = line + b"".join(b"\r\n" + n + sep + v for n, sep, v in fields)
    check(head)


# One edit of a byte string: (where, modulo its length; set/insert/delete; which byte -- the
# ones framing cares about first). fuzz/test_h1_fuzz.py mutates with the same.
EDIT = st.tuples(st.integers(0, 10_000), st.sampled_from(["set", "insert", "delete"]),
                 st.sampled_from([0, 9, 10, 13, 32, 44, 58, 59, 127, 128, 255])
                 | st.integers(0, 255))


def mutate(data: bytes, edits: list[tuple[int, str, int]]) -> bytes:
    out = bytearray(data)
    for i, op, byte in edits:
        if not out:
            break
        i %= len(out)
        if op == "set":
            out[i] = byte
        elif op == "insert":
            out.insert(i, byte)
        else:
            del out[i]
    return bytes(out)


@FAST
@given(st.lists(EDIT, min_size=1, max_size=4))
def test_mutated_heads_are_read_as_h11_reads_them_or_refused(edits):
    check(mutate(b"POST /v1/chat?x=1 HTTP/1.1\r\nHost: hub\r\nContent-Length: 12\r\n"
                 b"Connection: keep-alive\r\nX-Trace: a b c", edits))


def test_framing_and_connection_fields():
    h = parse_head(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 007\r\nExpect: 100-Continue")
    assert (h.length, h.chunked, h.keep_alive, h.expect_continue) == (7, False, True, True)
    h = parse_head(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n"
                   b"Connection: Keep-Alive, Close")
    assert (h.chunked, h.keep_alive) == (True, False)
    h = parse_head(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nExpect: 100-continue")
    assert (h.version, h.keep_alive, h.expect_continue) == ("1.0", False, False)
    for bad, status in ((b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                         b"Transfer-Encoding: chunked", 400),
                        (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 1",
                         400),
                        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                         b"Transfer-Encoding: chunked", 400),
                        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity", 501),
                        (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y", 400),
                        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"A: b\r\n" * 200 + b"A: b", 431)):
        with pytest.raises(BadRequest) as e:
            parse_head(bad)
        assert e.value.status == status


def encode_chunked(body: bytes, sizes: list[int], ext: bool) -> bytes:
    out, i = [], 0
    for n in sizes:
        part = body[i:i + n]
        if not part:
            break
        i += len(part)
        out.append(b"%x%s\r\n%s\r\n" % (len(part), b";a=b" if ext else b"", part))
    if i < len(body):
        out.append(b"%X\r\n%s\r\n" % (len(body) - i, body[i:]))
    return b"".join(out) + b"0\r\nX-Trailer: t\r\n\r\n"


@FAST
@given(st.binary(max_size=3000), st.lists(st.integers(1, 700), max_size=8), st.booleans(),
       st.lists(st.integers(1, 400), min_size=1, max_size=30), st.binary(max_size=20))
def test_chunked_bodies_read_whole_whatever_pieces_they_come_in(body, sizes, ext, cuts, after):
    wire = encode_chunked(body, sizes, ext)
    c, got, pos = ChunkedBody(), b"", 0
    for n in cuts * (len(wire) // sum(cuts) + 2):
        got += c.feed(wire[pos:pos + n] + (after if pos + n >= len(wire) else b""))
        pos += n
        if c.done:
            break
    assert c.done and got == body and c.error is None
    assert c.leftover.startswith(after[:len(c.leftover)])  # a pipelined request's bytes, kept


@FAST
@given(st.binary(max_size=200))
def test_garbage_chunked_bodies_raise_only_body_error_and_never_invent_data(wire):
    c = ChunkedBody()
    try:
        data = c.feed(wire)
    except BodyError:
        return
    assert len(data) + len(c.leftover) <= len(wire)


# --- the live server under mutated requests ------------------------------------------------


@pytest.fixture(scope="module")
def live_server():
    """A lean server in a thread (hypothesis drives blocking sockets at it)."""
    import threading
    from functools import partial

    import trio

    from appliance.http.asgi import read_body
    from appliance.server.serve import serve

    async def echo(scope, receive, send):
        body = await read_body(receive, 1 << 16)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d" % len(body)})

    ready: dict = {}
    started = threading.Event()

    async def main():
        stop = trio.Event()
        ready["stop"], ready["token"] = stop, trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as n:
            ready["addr"] = await n.start(partial(serve, echo, "127.0.0.1:0", "fuzz",
                                                  shutdown_trigger=stop.wait, drain_seconds=1))
            started.set()

    t = threading.Thread(target=trio.run, args=(main,), daemon=True)
    t.start()
    assert started.wait(10)
    yield ready["addr"]
    trio.from_thread.run_sync(ready["stop"].set, trio_token=ready["token"])
    t.join(10)


def _exchange(addr, data: bytes, cuts: list[int]) -> bytes:
    import socket
    import time

    s = socket.create_connection(addr, timeout=10)
    try:
        pos = 0
        for c in cuts + [len(data)]:
            s.sendall(data[pos:pos + c])
            pos += c
            if pos >= len(data):
                break
            time.sleep(0.001)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got
    except ConnectionResetError:
        return got
    finally:
        s.close()


GOOD = (b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
        b"POST /v1/y HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.data())
def test_the_live_server_answers_mutated_requests_or_closes_and_stays_up(live_server, data):
    raw = bytearray(GOOD)
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.sampled_from([0, 10, 13, 32, 48, 58, 70, 255]))
    cuts = data.draw(st.lists(st.integers(1, 40), max_size=4))
    got = _exchange(live_server, bytes(raw), cuts)
    statuses = [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", got)]
    assert set(statuses) <= {200, 400, 431, 501, 505}, got[:300]
    if bytes(raw) == GOOD:
        assert statuses == [200, 200] and got.endswith(b"3")
    assert _exchange(live_server, GOOD, []).count(b"HTTP/1.1 200") == 2  # still serving
