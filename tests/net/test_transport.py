"""One connection's bytes, plain or TLS (appliance/net/transport.py): reads end cleanly at
the peer's end or reset, honour deadlines, and writes raise once the peer is gone."""

from __future__ import annotations

import socket

import pytest
import trio

from appliance.net.transport import Transport


async def test_receive_reads_ends_and_honours_deadlines(autojump_clock):
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    t = Transport(a)
    with a, b:
        with trio.move_on_after(5) as cs:
            await t.receive(100)  # nothing sent: waits until the deadline
        assert cs.cancelled_caught
        b.send(b"hello")
        assert await t.receive(100) == b"hello"
        b.shutdown(socket.SHUT_WR)
        assert await t.receive(100) == b""


async def test_a_plain_transport_reads_nowait_and_says_the_end_on_a_reset():
    a, b = socket.socketpair()
    t = Transport(a)
    assert t.receive_nowait() is None  # nothing yet: a read would wait
    b.send(b"x")
    assert t.receive_nowait() == b"x"
    b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    b.close()  # a reset, not a clean end: the same b""
    assert await t.receive() == b""
    with pytest.raises(OSError):
        for _ in range(100):  # the kernel tells a write to a dead peer within a few
            await t.send_all(b"y" * 65536)
    t.close()
    assert t.sock.fileno() == -1
