"""The pass-through relay (appliance/http/stream.py `relay_body` over appliance/client/upstream.py's
Response) against raw trio peers that send exact bytes: the read deadline is exact though
it is kept lazily (one cancel scope per relay), a cut interrupts a read but never a write,
broken framing is an error and not a hang, and a body that ended by its framing hands its
connection back to the pool. The client side is our server's own send path
(appliance/server/send.py) on a socket pair: the relay writes through it."""

import socket
from functools import partial

import h11
import pytest
import trio
import trio.testing

from appliance.client.upstream import Pool, UpstreamError
from appliance.h1.body import ChunkedBody
from appliance.http.stream import Cut, relay_body
from appliance.hub.translate import Converted
from appliance.net.transport import Transport
from appliance.server.send import Sender
from tests.harness.h11io import request

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def frame(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


async def _peer(stream, *, script: list, served: list) -> None:
    """Answer each request on the connection with `script`: bytes are sent, a number is
    slept, "CLOSE" closes, "STALL" sleeps forever; after the script, the next request."""
    while True:
        conn = h11.Connection(h11.SERVER)
        if not await request(stream, conn):
            return
        served.append(trio.current_time())
        for step in script:
            if step == "CLOSE":
                await stream.aclose()
                return
            if step == "STALL":
                await trio.sleep_forever()
            if isinstance(step, (int, float)):
                await trio.sleep(step)
            else:
                await stream.send_all(step)


async def _start(nursery, script: list):
    served: list = []
    listeners = await nursery.start(partial(trio.serve_tcp, partial(_peer, script=script,
                                                                    served=served), 0,
                                            host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/x", served


class Client:
    """The client: our server's send side on a socket pair, its chunked frames decoded by
    a reader. `delay` makes each write slow: the reader sleeps between reads of a socket
    whose buffers are small, so a big write waits for room."""

    def __init__(self, delay: float = 0.0) -> None:
        self.body = b""
        self.delay = delay
        self._sock, self._peer = socket.socketpair()
        self._peer.setblocking(False)
        if delay:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            self._peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sender = Sender(Transport(self._sock))
        self.sender.new_response("POST", "1.1")
        self.sender.started = True  # (the response's head: a status, no headers)
        self.sender.status = 200

    async def send(self, msg) -> None:
        await self.sender.send(msg)

    async def read_frames(self) -> None:
        frames = ChunkedBody()
        head = b""
        while True:
            if self.delay:
                await trio.sleep(self.delay)
            await trio.lowlevel.wait_readable(self._peer)
            data = self._peer.recv(1024)
            if not data:
                return
            if head is not None:
                head += data
                if b"\r\n\r\n" not in head:
                    continue
                assert b"transfer-encoding: chunked" in head
                data = head.partition(b"\r\n\r\n")[2]
                head = None
            self.body += frames.feed(data)

    def end(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)


async def _relay(script, *, read_timeout=5.0, cut=None, errors=(UpstreamError,),
                 client=None, trip_at=None):
    client = client or Client()
    async with trio.open_nursery() as nursery:
        url, served = await _start(nursery, script)
        pool = Pool()
        resp = await pool.request("POST", url, [], b"{}", read_timeout=read_timeout)
        if trip_at is not None:
            async def trip():
                await trio.sleep(trip_at)
                cut.trip("node_lost")
            nursery.start_soon(trip)
        reader = trio.Event()

        async def read():
            await client.read_frames()
            reader.set()
        nursery.start_soon(read)
        raised = None
        try:
            r = await relay_body(resp, client.send, cut, errors, b"")
        except UpstreamError as e:  # raised outside the nursery: not in an ExceptionGroup
            raised = e
        finally:
            await resp.aclose()
            client.end()
        await reader.wait()
        nursery.cancel_scope.cancel()
    if raised is not None:
        raise raised
    return r, client, pool, served


async def test_the_read_deadline_counts_from_the_last_read_not_from_the_start(autojump_clock):
    t0 = trio.current_time()
    script = [HEAD + frame(b"a"), 3, frame(b"b"), 3, frame(b"c"), "STALL"]
    r, client, _, _ = await _relay(script=script, read_timeout=5)
    # 6 s of tokens, then silence: it ends 5 s after the last byte, not at 5 s (the first
    # deadline, moved lazily) nor ever later.
    assert client.body == b"abc"
    assert not r.ended and "sent nothing for 5 s" in r.failure
    assert 11 <= trio.current_time() - t0 < 11.1


async def test_a_read_deadline_not_in_errors_is_raised(autojump_clock):
    with pytest.raises(UpstreamError, match="sent nothing for 2 s"):
        await _relay(script=[HEAD + frame(b"a"), "STALL"], read_timeout=2, errors=())


async def test_a_body_that_ends_by_its_framing_ends_the_relay_and_its_connection_is_kept():
    r, client, pool, _ = await _relay(script=[HEAD + frame(b"a") + frame(b"b"), frame(b"c") + b"0\r\n\r\n",
                                       "STALL"])
    assert r.ended and client.body == b"abc" and r.tail == b"bc"[-2:]
    assert pool.idle_count() == 1


async def test_a_kept_connection_serves_the_next_request():
    async with trio.open_nursery() as nursery:
        url, served = await _start(nursery, [HEAD + frame(b"hi") + b"0\r\n\r\n"])
        pool = Pool()
        for _ in range(3):
            resp = await pool.request("POST", url, [], b"{}", read_timeout=5)
            assert await resp.read() == b"hi"
            await resp.aclose()
        assert len(served) == 3 and pool.idle_count() == 1  # one connection, three exchanges
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_bytes_after_the_body_close_the_connection():
    _, client, pool, _ = await _relay(script=[HEAD + frame(b"a") + b"0\r\n\r\nJUNK", "STALL"])
    assert client.body == b"a" and pool.idle_count() == 0


@pytest.mark.parametrize(("bad", "passed"), [
    (b"zz\r\nhello\r\n", b"ok"), (b"1" * 9000, b"ok"), (b"5\nhello\r\n", b"ok"),
    (b"5\r\nhelloXX", b"okhello"),  # the payload before the break is passed on, then the error
])
async def test_broken_framing_is_an_error_not_a_hang(bad, passed, autojump_clock):
    t0 = trio.current_time()
    r, client, pool, _ = await _relay(script=[HEAD + frame(b"ok") + bad, "STALL"], read_timeout=60)
    assert client.body == passed
    assert "broke off the response" in r.failure and not r.ended
    assert trio.current_time() - t0 < 1  # at once, not at the read deadline
    assert pool.idle_count() == 0


async def test_a_peer_gone_mid_body_is_an_error():
    r, client, _, _ = await _relay(script=[HEAD + frame(b"a") + b"5\r\nhe", "CLOSE"])
    assert client.body == b"ahe" and "closed the connection mid-response" in r.failure


async def test_a_cut_interrupts_the_read_at_once(autojump_clock):
    t0 = trio.current_time()
    cut = Cut()
    r, client, _, _ = await _relay(script=[HEAD + frame(b"a"), 1, frame(b"b"), "STALL"], cut=cut,
                                   read_timeout=100, trip_at=3)
    assert client.body == b"ab" and not r.ended and not r.failure and cut.reason == "node_lost"
    assert 3 <= trio.current_time() - t0 < 3.1


BIG = b"x" * 60000  # many times the small socket buffers: a write of it waits


async def test_a_cut_never_interrupts_a_write(autojump_clock):
    cut = Cut()
    # each write is slow (the reader takes 1 KiB per 0.05 s from a 4 KiB buffer, ~3 s for
    # BIG): the cut comes in the middle of one
    client = Client(delay=0.05)
    r, client, _, _ = await _relay(script=[HEAD + frame(b"a") + frame(BIG), "STALL"],
                                   cut=cut, client=client, read_timeout=100, trip_at=1)
    assert client.body == b"a" + BIG and cut.reason == "node_lost" and not r.ended


async def test_a_slow_write_does_not_count_against_the_read_deadline(autojump_clock):
    client = Client(delay=0.05)  # each write of BIG takes more than half the deadline
    script = [HEAD + frame(BIG), frame(BIG), frame(b"c") + b"0\r\n\r\n", "STALL"]
    r, client, _, _ = await _relay(script=script, client=client, read_timeout=2)
    assert r.ended and client.body == BIG + BIG + b"c"


class Upper:
    """A converter that parses nothing: upper-cases, and ends with b"END"."""

    content_type = b"text/plain"

    def feed(self, chunk: bytes) -> bytes:
        return chunk.upper()

    def end(self) -> bytes:
        return b"END"


async def test_a_translated_answer_goes_through_the_converter_with_the_same_deadline(
        autojump_clock):
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, [HEAD + frame(b"a"), 2, frame(b"b") + b"0\r\n\r\n"])
        resp = await Pool().request("POST", url, [], b"{}", read_timeout=5)
        client = Client()
        nursery.start_soon(client.read_frames)
        body = Converted(resp, Upper())
        r = await relay_body(body, client.send, Cut(), (UpstreamError,), b"")
        client.end()
        await trio.sleep(0.1)
        assert r.ended and body.ended and client.body == b"ABEND"
        await resp.aclose()
        nursery.cancel_scope.cancel()
    # silence after the first event: the read deadline, through the converter
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, [HEAD + frame(b"a"), "STALL"])
        resp = await Pool().request("POST", url, [], b"{}", read_timeout=5)
        client = Client()
        nursery.start_soon(client.read_frames)
        t0 = trio.current_time()
        r = await relay_body(Converted(resp, Upper()), client.send, Cut(), (UpstreamError,), b"")
        assert "sent nothing for 5 s" in r.failure and 5 <= trio.current_time() - t0 < 5.1
        await resp.aclose()
        client.end()
        nursery.cancel_scope.cancel()
