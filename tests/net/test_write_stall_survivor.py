"""The write stall counts from the last progress, not from the write's start (issue 30
item 10: a mutant computing the deadline once survived every fast test). Virtual time."""

from __future__ import annotations

import socket

import pytest
import trio

from appliance.net.transport import Transport, WriteStalled

DATA = b"x" * (4 << 20)  # far more than a socketpair's buffers hold


async def slow_reader(sock: socket.socket, every: float, n: int, got: list[int]) -> None:
    """Reads `n` bytes at a time, every `every` seconds, until the end."""
    while True:
        await trio.sleep(every)
        try:
            chunk = sock.recv(n)
        except BlockingIOError:
            continue
        if not chunk:
            return
        got[0] += len(chunk)


async def test_a_slow_steady_reader_is_not_cut(autojump_clock):
    a, b = socket.socketpair()
    b.setblocking(False)
    t = Transport(a, stall=1.0)
    got = [0]
    with a, b:
        async with trio.open_nursery() as n:
            n.start_soon(slow_reader, b, 0.5, 256 << 10, got)
            start = trio.current_time()
            await t.send_all(DATA)  # a steady reader: never 1 s without progress
            a.shutdown(socket.SHUT_WR)
        assert got[0] == len(DATA) and trio.current_time() - start > 5  # well past one stall


async def test_a_reader_that_stops_is_cut_after_the_stall(autojump_clock):
    a, b = socket.socketpair()
    b.setblocking(False)
    t = Transport(a, stall=1.0)
    with a, b:
        start = trio.current_time()
        with pytest.raises(WriteStalled):
            await t.send_all(DATA)
        assert trio.current_time() - start == pytest.approx(1.0)
