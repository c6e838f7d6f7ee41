"""What one relayed event costs a trio process at the least, against the project's relay loop.

Run: .venv/bin/python bench/relay_floor.py [--streams 64] [--rate 50] [--seconds 5] [--runs 3]

A writer (this process, plain sockets) sends N paced streams of chunked SSE frames into
socket pairs; a child process relays each stream to a second socket pair, from which a
reader thread here counts the events. The child is one of:

- `raw`: trio at its floor -- per event `wait_readable`, `recv`, `send` on plain sockets,
  nothing parsed (what any trio relay pays: one wakeup of the run loop, an epoll re-arm,
  two socket syscalls);
- `trio-socket`: the same through trio's socket methods (`await sock.recv`, `await
  sock.send`: a scheduler round trip around each call);
- `relay`: the project's pass-through relay -- appliance/client/upstream.py's Response reading
  the chunked body (appliance/h1/body.py), appliance/http/stream.py's `relay_body`
  (one cancel scope per relay, a lazy read deadline, a Cut) writing through the server's
  ASGI `send` (appliance/server/send.py), the one path every response byte takes;
- `epoll`: no trio -- a plain loop over one epoll registered once (`poll`, `recv`, `send`
  per event): what a relay outside trio's run loop would pay in Python.

It prints the child's CPU per event (utime + stime from wait4). `relay` minus `raw` is
what the project's code adds per event; `raw` minus `epoll` is what trio's run loop costs
per wakeup, which only fewer wakeups (more events per read), more processes, or a relay
outside trio can lower. The modes run interleaved, --runs times each: on a shared
machine compare the rows of one run.
"""

from __future__ import annotations

import argparse
import os
import selectors
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
FRAME = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)


def child(mode: str, ins: list[socket.socket], outs: list[socket.socket]) -> None:
    import trio

    async def raw(src: socket.socket, dst: socket.socket) -> None:
        fd = src.fileno()
        while True:
            await trio.lowlevel.wait_readable(fd)
            data = src.recv(65536)
            if not data:
                return
            dst.send(data)

    async def trio_socket(src: socket.socket, dst: socket.socket) -> None:
        s, d = trio.socket.from_stdlib_socket(src), trio.socket.from_stdlib_socket(dst)
        while True:
            data = await s.recv(65536)
            if not data:
                return
            await d.send(data)

    async def relay(src: socket.socket, dst: socket.socket) -> None:
        from appliance.client.upstream import Pool, Response, UpstreamError, _Conn
        from appliance.h1.parse import parse_response_head
        from appliance.http.stream import Cut, relay_body
        from appliance.net.transport import Transport
        from appliance.server.send import Sender

        got = parse_response_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        assert got is not None
        resp = Response(Pool(), ("http", "x", 1), _Conn(Transport(src)), got[0], 60.0)
        out = Sender(Transport(dst))  # the server's send path: what every response byte takes
        out.started, out.status = True, 200
        await relay_body(resp, out.send, Cut(), (UpstreamError,), b"")

    if mode == "epoll":
        # No trio: one level-triggered epoll registered once, a plain loop (what a relay
        # outside trio's run loop -- a thread of its own, as nginx's event loop -- pays).
        import select

        ep = select.epoll()
        dst_of = {}
        for src, dst in zip(ins, outs, strict=True):
            src.setblocking(False)
            ep.register(src.fileno(), select.EPOLLIN)
            dst_of[src.fileno()] = (src, dst)
        while dst_of:
            for fd, _ in ep.poll():
                src, dst = dst_of[fd]
                data = src.recv(65536)
                if not data:
                    ep.unregister(fd)
                    del dst_of[fd]
                else:
                    dst.send(data)
        return
    fn = {"raw": raw, "trio-socket": trio_socket, "relay": relay}[mode]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for src, dst in zip(ins, outs, strict=True):
                src.setblocking(False)
                dst.setblocking(False)
                nursery.start_soon(fn, src, dst)

    trio.run(main)


def run(mode: str, streams: int, rate: float, seconds: float) -> tuple[int, float, float]:
    ins = [socket.socketpair() for _ in range(streams)]
    outs = [socket.socketpair() for _ in range(streams)]
    pid = os.fork()
    if pid == 0:
        try:
            for a, _ in ins:
                a.close()
            for _, b in outs:
                b.close()
            child(mode, [b for _, b in ins], [a for a, _ in outs])
        finally:
            os._exit(0)
    for _, b in ins:
        b.close()
    for a, _ in outs:
        a.close()
    events = [0]

    def drain() -> None:
        sel = selectors.DefaultSelector()
        for _, b in outs:
            sel.register(b, selectors.EVENT_READ)
        left = streams
        while left:
            for key, _ in sel.select():
                data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                if not data:
                    sel.unregister(key.fileobj)
                    left -= 1
                else:
                    events[0] += data.count(b"data: ")

    reader = threading.Thread(target=drain)
    reader.start()
    time.sleep(0.5)  # the child is up
    interval = 1.0 / (rate * streams)
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        ins[i % streams][0].send(FRAME)
        i += 1
        delay = t0 + i * interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    for a, _ in ins:
        a.close()
    reader.join()
    _, _, usage = os.wait4(pid, 0)
    for _, b in outs:
        b.close()
    return events[0], usage.ru_utime, usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--rate", type=float, default=50.0, help="events/s per stream")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="epoll,raw,trio-socket,relay")
    args = ap.parse_args()
    print(f"{args.streams} streams x {args.rate:g} events/s, {args.seconds:g} s per mode and run")
    print(f"{'run':>4} {'mode':<12}{'events':>8}{'us/event':>10}{'user':>7}{'sys':>7}")
    for r in range(args.runs):
        for mode in args.modes.split(","):
            n, user, sys_ = run(mode, args.streams, args.rate, args.seconds)
            n = max(1, n)
            print(f"{r + 1:>4} {mode:<12}{n:>8}{(user + sys_) / n * 1e6:>10.1f}"
                  f"{user / n * 1e6:>7.1f}{sys_ / n * 1e6:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
