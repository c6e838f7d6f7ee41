"""The proxy's own HTTP/1.1 client (appliance/client/upstream.py) against raw trio servers:
reuse of kept connections, a pooled connection the peer closed while idle, a body the
peer broke off, and a peer that never answers."""

from functools import partial

import h11
import pytest
import trio
import trio.testing

from appliance.client.upstream import Pool, UpstreamError
from tests.harness.h11io import request


async def _serve_one_per_connection(stream, *, served: list, close_after: bool, chunks: list[bytes],
                                    stall: bool = False):
    """Answer one request on this connection, then close it (as an idle timeout would)."""
    conn = h11.Connection(h11.SERVER)
    if not await request(stream, conn):
        return
    served.append(1)
    if stall:
        await trio.sleep_forever()
    out = conn.send(h11.Response(status_code=200, headers=[(b"transfer-encoding", b"chunked")]))
    await stream.send_all(out)
    for c in chunks:
        if c == b"BREAK":
            await stream.aclose()
            return
        await stream.send_all(conn.send(h11.Data(data=c)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
    if close_after:
        await stream.aclose()
    else:
        await trio.sleep_forever()


async def _start(nursery, **kw):
    served: list = []
    listeners = await nursery.start(partial(trio.serve_tcp, partial(_serve_one_per_connection,
                                                                    served=served, **kw), 0,
                                            host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}/x", served


async def test_a_pooled_connection_the_peer_closed_is_retried_on_a_fresh_one():
    async with trio.open_nursery() as nursery:
        url, served = await _start(nursery, close_after=True, chunks=[b"hello"])
        pool = Pool()
        for _ in range(3):
            resp = await pool.request("POST", url, [], b"{}", read_timeout=5)
            assert resp.status_code == 200 and await resp.read() == b"hello"
            await trio.testing.wait_all_tasks_blocked()  # let the peer's close land
        assert len(served) == 3
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_finished_exchange_goes_back_to_the_pool():
    async with trio.open_nursery() as nursery:
        url, served = await _start(nursery, close_after=False, chunks=[b"a", b"b", b"c"])
        pool = Pool()
        resp = await pool.request("POST", url, [], b"{}", read_timeout=5)
        parts = [c async for c in resp.chunks()]
        assert b"".join(parts) == b"abc"
        await resp.aclose()
        assert len(pool._idle[("http", "127.0.0.1", int(url.split(":")[2].split("/")[0]))]) == 1
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_body_broken_off_is_an_upstream_error_after_the_response():
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, close_after=False, chunks=[b"first", b"BREAK"])
        pool = Pool()
        resp = await pool.request("POST", url, [], b"{}", read_timeout=5)
        got = []
        with pytest.raises(UpstreamError) as e:
            async for c in resp.chunks():
                got.append(c)
        assert got == [b"first"] and e.value.before_response is False
        nursery.cancel_scope.cancel()


async def test_silence_is_bounded_by_the_read_timeout(autojump_clock):
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, close_after=False, chunks=[], stall=True)
        pool = Pool()
        start = trio.current_time()
        with pytest.raises(UpstreamError) as e:
            await pool.request("POST", url, [], b"{}", read_timeout=30)
        assert trio.current_time() - start == pytest.approx(30) and e.value.before_response
        nursery.cancel_scope.cancel()


async def test_nobody_listening_fails_before_the_response():
    with trio.socket.socket() as s:
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(UpstreamError) as e:
        await Pool().request("POST", f"http://127.0.0.1:{port}/x", [], b"", read_timeout=5)
    assert e.value.before_response and "connect" in str(e.value)


async def test_a_url_without_a_host_is_an_upstream_error_not_a_crash():
    with pytest.raises(UpstreamError) as e:
        await Pool().request("POST", "http:///x", [], b"", read_timeout=5)
    assert e.value.before_response and "no host" in str(e.value)


async def test_idle_connections_the_peer_closed_are_closed_not_kept(autojump_clock):
    async with trio.open_nursery() as nursery:
        url, _ = await _start(nursery, close_after=False, chunks=[b"ok"])
        pool = Pool()
        resp = await pool.request("POST", url, [], b"{}", read_timeout=5)
        assert await resp.read() == b"ok"
        await resp.aclose()
        assert pool.idle_count() == 1
        (conn,) = [c for conns in pool._idle.values() for c in conns]
        assert not conn.peer_closed() and pool.sweep() == 0
        # The peer hangs up while the connection idles: the sweep closes our side too.
        nursery.cancel_scope.cancel()
    await trio.sleep(0.1)
    assert conn.peer_closed()
    assert pool.sweep() == 1 and pool.idle_count() == 0
    assert conn.transport.sock.fileno() == -1  # closed now, not left to the garbage collector
