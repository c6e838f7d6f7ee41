"""The minimum read rate (issue 30 item 4): a peer that is behind -- the writes wait on it --
and reads slower than `min_rate` over waits summing to the stall is cut like a stalled one;
time the writer did not wait never counts. Virtual time, a socketpair, plain and TLS."""

from __future__ import annotations

import socket
import ssl

import pytest
import trio
import trustme

from appliance.config.env import load
from appliance.hub.hub import hub_limits
from appliance.net.transport import TlsTransport, Transport, WriteStalled
from appliance.node.run import node_limits

PIECE = 64 << 10
# A reader taking 64 KiB every 0.1 s: 655,360 bytes a second, progress well within a
# 1 s stall each time (the socketpair's writer wakes at every read).
EVERY = 0.1


async def steady_reader(read: object, got: list[int]) -> None:
    """Reads at most PIECE every EVERY seconds until the end (`read` is a socket or a
    trio stream)."""
    while True:
        await trio.sleep(EVERY)
        if isinstance(read, socket.socket):
            try:
                chunk = read.recv(PIECE)
            except BlockingIOError:
                continue
        else:
            assert isinstance(read, trio.SSLStream)
            chunk = b""
            while len(chunk) < PIECE:  # one TLS record (16 KiB) per receive_some
                try:
                    more = bytes(await read.receive_some(PIECE - len(chunk)))
                except trio.BrokenResourceError:  # our end, without a close_notify
                    more = b""
                if not more:
                    break
                chunk += more
        if not chunk:
            return
        got[0] += len(chunk)


async def write(t: Transport, total: int) -> None:
    for _ in range(total // PIECE):
        await t.send_all(b"x" * PIECE)


async def run_plain(rate: float, total: int, pause: float = 0.0) -> tuple[float, int]:
    """Writes `total` bytes (twice with `pause` between when asked) to the steady reader
    through a Transport of stall 1 s; the virtual seconds taken and the bytes read."""
    a, b = socket.socketpair()
    b.setblocking(False)
    t = Transport(a, stall=1.0, min_rate=rate)
    got = [0]
    with a, b:
        async with trio.open_nursery() as n:
            n.start_soon(steady_reader, b, got)
            start = trio.current_time()
            cut: WriteStalled | None = None
            try:
                await write(t, total)
                if pause:
                    await trio.sleep(pause)  # the reader catches up: nobody waits
                    await write(t, total)
                a.shutdown(socket.SHUT_WR)
            except WriteStalled as e:
                cut = e
                n.cancel_scope.cancel()
            took = trio.current_time() - start
    if cut is not None:
        raise cut
    return took, got[0]


async def test_a_steady_reader_slower_than_the_minimum_is_cut_within_two_stalls(autojump_clock):
    with pytest.raises(WriteStalled) as e:
        await run_plain(1_000_000, 16 << 20)
    assert not e.value.drained and "bytes/s" in str(e.value)


async def test_when_cut_it_was_behind_for_the_stall_not_at_once(autojump_clock):
    a, b = socket.socketpair()
    b.setblocking(False)
    t = Transport(a, stall=1.0, min_rate=1_000_000)
    got = [0]
    with a, b:
        async with trio.open_nursery() as n:
            n.start_soon(steady_reader, b, got)
            start = trio.current_time()
            with pytest.raises(WriteStalled):
                await write(t, 16 << 20)
            took = trio.current_time() - start
            n.cancel_scope.cancel()
    # Judged only once the waits sum to the stall, and then at the next wait.
    assert 1.0 <= took < 2.0, took
    assert got[0] > 0


async def test_a_reader_above_the_minimum_gets_everything(autojump_clock):
    took, got = await run_plain(100_000, 8 << 20)
    assert got == 8 << 20 and took > 5  # behind for many stalls, never cut


async def test_time_the_writer_did_not_wait_is_not_counted(autojump_clock):
    # Behind, then a minute with nothing to write, then behind again: the pause is not
    # the reader's slowness (over the wall-clock span it read far under the minimum).
    took, got = await run_plain(300_000, 4 << 20, pause=60.0)
    assert got == 8 << 20 and took > 60


async def test_rate_zero_keeps_only_the_stall(autojump_clock):
    took, got = await run_plain(0, 4 << 20)
    assert got == 4 << 20


@pytest.fixture(scope="module")
def tls_pair() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def run_tls(rate: float, total: int, ctxs: tuple[ssl.SSLContext, ssl.SSLContext]) -> int:
    a, b = socket.socketpair()
    t = TlsTransport(a, ctxs[0], server_side=True, stall=1.0, min_rate=rate)
    peer = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(b)), ctxs[1],
                          server_hostname="localhost")
    got = [0]
    cut: WriteStalled | None = None
    with a, b:
        async with trio.open_nursery() as n:
            n.start_soon(steady_reader, peer, got)
            try:
                await write(t, total)
                a.shutdown(socket.SHUT_WR)
            except WriteStalled as e:
                cut = e
                n.cancel_scope.cancel()
    if cut is not None:
        raise cut
    return got[0]


async def test_tls_a_reader_slower_than_the_minimum_is_cut(autojump_clock, tls_pair):
    with pytest.raises(WriteStalled) as e:
        await run_tls(1_000_000, 16 << 20, tls_pair)
    assert not e.value.drained


async def test_tls_a_reader_above_the_minimum_gets_everything(autojump_clock, tls_pair):
    assert await run_tls(100_000, 4 << 20, tls_pair) >= (4 << 20) - PIECE


def test_the_settings_reach_the_listeners() -> None:
    cfg = load({})
    assert hub_limits(cfg).min_read_bytes_per_second == 1024  # on for clients by default
    assert node_limits(cfg).min_read_bytes_per_second == 0  # the hub keeps it for them
    cfg = load({"Hub__MinReadBytesPerSecond": "5000", "Node__MinReadBytesPerSecond": "7"})
    assert hub_limits(cfg).min_read_bytes_per_second == 5000
    assert node_limits(cfg).min_read_bytes_per_second == 7


async def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A loopback TCP pair (the unsent count, SIOCOUTQNSD, is TCP's): writer, reader."""
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        b = socket.socket()
        b.setblocking(False)
        try:
            b.connect(ls.getsockname())
        except BlockingIOError:
            pass
        await trio.lowlevel.wait_writable(b)
        a, _ = ls.accept()
    a.setblocking(False)
    return a, b


def fill(a: socket.socket) -> int:
    """Writes until the kernel's buffers are full; how much."""
    n = 0
    while True:
        try:
            n += a.send(b"x" * PIECE)
        except BlockingIOError:
            return n


async def run_end(rate: float, every: float) -> tuple[bool, int, int]:
    """A stream's end on TCP: the buffers full, a reader taking PIECE every `every` s;
    what `wait_sent` says (stall 1 s, `rate`), what was written, what was read by then."""
    a, b = await tcp_pair()
    t = Transport(a, stall=1.0, min_rate=rate)
    got = [0]
    with a, b:
        written = fill(a)
        async with trio.open_nursery() as n:
            n.start_soon(steady_reader_every, b, every, got)
            ok = await t.wait_sent()
            n.cancel_scope.cancel()
    return ok, written, got[0]


async def steady_reader_every(sock: socket.socket, every: float, got: list[int]) -> None:
    while True:
        await trio.sleep(every)
        try:
            got[0] += len(sock.recv(PIECE))
        except BlockingIOError:
            pass


async def test_the_streams_end_waits_while_a_steady_reader_drains_it(autojump_clock):
    # Far more buffered than leaves in one stall: a reader that progresses all the time
    # (above the minimum) is waited for -- it was cut after one stall before.
    ok, written, got = await run_end(100_000, EVERY)
    assert written > 10 * PIECE and ok


async def test_the_streams_end_cuts_a_reader_under_the_minimum(autojump_clock):
    ok, written, got = await run_end(10_000_000, EVERY)
    assert not ok and 0 < got < written


async def test_the_streams_end_cuts_a_reader_that_stopped(autojump_clock):
    ok, _, got = await run_end(0, 3600.0)
    assert not ok and got == 0
