"""One connection's bytes, plain or TLS, behind one interface (`Transport`).

Owns the socket calls of the server and the client. A relayed token costs one read and one
write per hop, and trio's socket calls add a scheduler round trip to each
(docs/streams-profile.md), so a plain connection is the stdlib socket itself, made or
accepted here: a read waits until readable (the one checkpoint) then `recv`s; a write
`send`s at once and waits only while the kernel's buffer is full. TLS is a
`trio.SSLStream` over a trio socket stream on that same socket: the same interface.
- `receive` returns b"" at the end of the stream and when the connection broke.
- `send_all` writes everything or raises `OSError`; its waits are shielded unless told
  otherwise (a write cut half-way leaves the peer's framing unknown) but never `stall`
  seconds without progress (`WriteStalled`), never past `abort_by` (the drain's end), and
  with a `min_rate`: while the writer waits (the peer is behind), once the waits sum to
  `stall` seconds the bytes written since the first of them over that time must reach
  `min_rate` (a slow steady reader holds a place no longer than a stopped one; time not
  waited is not counted, so a pausing answer is never a slow reader). The caller holds a
  lock if two tasks could write (trio's SSLStream refuses concurrent sends).
- `shutdown_write` sends our end (a TCP FIN; on TLS under the records, without a
  close_notify) so a closing server can drain the read side.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import socket
import ssl
import struct
from collections.abc import Iterator

import trio

# What one read asks for: a relayed body's reads are this or smaller.
READ_BYTES = 65536
# A TLS close sends close_notify; a peer that does not read gets no more than this.
CLOSE_NOTIFY_SECONDS = 1.0
# What a broken or closed connection raises out of trio (a read or write on it).
_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


def nodelay(sock: socket.socket) -> None:
    """Small writes go out at once (as trio's SocketStream sets it): a token is a write."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


# What one TLS write waits for at most before it must have progressed (the TLS stream
# shows no partial progress: it is fed in pieces this large).
TLS_PIECE = 16 * 1024


# Linux's SIOCOUTQNSD (linux/sockios.h): bytes of a TCP socket's send queue not yet sent
# (a peer whose receive window is shut keeps them there). Unlike SIOCOUTQ it does not count
# bytes sent but not yet acknowledged, so a reading peer's delayed ACK costs no wait.
SIOCOUTQNSD = 0x894B
_INT = struct.Struct("i")


def unsent(sock: socket.socket) -> int:
    """Bytes written to `sock` the kernel has not sent yet; 0 when it cannot say."""
    try:
        return int(_INT.unpack(fcntl.ioctl(sock.fileno(), SIOCOUTQNSD, b"\0" * 4))[0])
    except (OSError, ValueError):
        return 0


class WriteStalled(OSError):
    """A write made no progress for the transport's `stall` seconds (`drained` False), or
    was aborted at the drain's end (`drained` True)."""

    def __init__(self, drained: bool, message: str) -> None:
        super().__init__(errno.ETIMEDOUT, message)
        self.drained = drained


_ABORTED = "the connection was aborted at the drain's end"


class Transport:
    """A plain connection: the socket itself (see the module's docstring)."""

    __slots__ = ("sock", "tls", "stall", "min_rate", "sent", "_by", "_wait", "_mark",
                 "_behind")

    def __init__(self, sock: socket.socket, stall: float = math.inf,
                 min_rate: float = 0.0) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.tls = False
        self.stall = stall  # seconds a write may make no progress (math.inf: unbounded)
        self.min_rate = min_rate  # bytes a second a peer that is behind reads at least (0: any)
        self.sent = 0  # bytes of finished `send_all`s
        self._by = math.inf  # no write waits past this (the drain's end)
        self._wait: trio.CancelScope | None = None  # the write waiting now
        self._mark = -1  # `sent` at the first wait of the read-rate span (-1: none open)
        self._behind = 0.0  # seconds waited in that span

    @contextlib.contextmanager
    def waiting(self, shield: bool, done: int = 0) -> Iterator[None]:
        """One wait of a write (`done`: its bytes already out): shielded as asked, ended by
        the stall or by `abort`; refused when the peer has been reading too slowly."""
        if self.aborted:
            raise WriteStalled(True, _ABORTED)
        start = trio.current_time()
        if self.min_rate:
            self._judge(self.sent + done)
        scope = trio.CancelScope(shield=shield, deadline=min(start + self.stall, self._by))
        self._wait = scope
        try:
            with scope:
                yield
        finally:
            self._wait = None
            self._behind += trio.current_time() - start
        if scope.cancelled_caught:
            if self.aborted:
                raise WriteStalled(True, _ABORTED)
            raise WriteStalled(False, f"the peer read nothing for {self.stall:g} s")

    def _judge(self, written: int) -> None:
        """At a wait (the buffers full again): once the span's waits reach `stall` seconds,
        the peer must have read `min_rate` bytes a second of them; then a new span opens."""
        if self._mark < 0:
            self._mark, self._behind = written, 0.0
            return
        if self._behind < self.stall:
            return
        rate = (written - self._mark) / self._behind
        if rate < self.min_rate:
            raise WriteStalled(False, f"the peer read {rate:.0f} bytes/s while behind for "
                                      f"{self._behind:.0f} s (under {self.min_rate:g})")
        self._mark, self._behind = written, 0.0

    @property
    def aborted(self) -> bool:
        """The drain's end (`abort_by`) has come: no write waits any more."""
        return trio.current_time() >= self._by

    async def wait_sent(self) -> bool:
        """Whether every byte written has left (the peer's window took it): a stream's end,
        so a client that read nothing of an answer the socket buffers held is not taken for
        one that received it. Waits while what is left goes down -- as a write waits: never
        `stall` seconds without progress, nor, with a `min_rate`, slower than it over spans
        of `stall` seconds -- and not past `abort_by`'s deadline, read at each look, so a
        drain that begins while it waits ends it too (`aborted` then says so)."""
        left = unsent(self.sock)
        if left <= 0:
            return True
        now = trio.current_time()
        moved = span_at = now  # the last progress; the read-rate span's start
        span_left = left
        pause = 0.001
        while left > 0:
            if self.min_rate and now - span_at >= self.stall:
                if span_left - left < self.min_rate * (now - span_at):
                    return False
                span_at, span_left = now, left
            deadline = min(moved + self.stall, self._by)
            if now >= deadline:
                return False
            with trio.CancelScope(shield=True):  # bounded by `deadline`
                await trio.sleep(min(pause, deadline - now))
            pause = min(pause * 2, 0.05)
            now, was, left = trio.current_time(), left, unsent(self.sock)
            if left < was:
                moved = now
        return True

    def abort_by(self, deadline: float) -> None:
        """No write waits past `deadline` (trio's clock): the one waiting now included."""
        self._by = min(self._by, deadline)
        if self._wait is not None:
            self._wait.deadline = min(self._wait.deadline, self._by)

    async def receive(self, max_bytes: int = READ_BYTES) -> bytes:
        """The next bytes (b"" at the end, or when the connection broke), with one
        checkpoint: the wait until the socket is readable."""
        sock = self.sock
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return sock.recv(max_bytes)
            except BlockingIOError:
                continue
            except OSError:
                return b""

    def receive_nowait(self, max_bytes: int = READ_BYTES) -> bytes | None:
        """What is already here (b"": the end), or None when a read would wait."""
        try:
            return self.sock.recv(max_bytes)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    async def send_all(self, data: bytes, shield: bool = True) -> None:
        """All of `data` (OSError when the peer is gone); waits only while the socket's
        buffer is full -- shielded unless told otherwise, each wait bounded by the stall
        and the read rate (`waiting`: any progress starts it again)."""
        sock = self.sock
        view = memoryview(data)
        while view:
            try:
                n = sock.send(view)
            except BlockingIOError:
                with self.waiting(shield, len(data) - len(view)):
                    await trio.lowlevel.wait_writable(sock)
                continue
            view = view[n:]
        self.sent += len(data)

    def shutdown_write(self) -> bool:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Close at once (nothing left to flush on a plain socket)."""
        self.sock.close()

    async def aclose(self) -> None:
        self.sock.close()
        await trio.lowlevel.checkpoint()


class TlsTransport(Transport):
    """A TLS connection over our socket: trio's SSLStream does the TLS (handshake on the
    first read or write, bounded by the caller's deadline)."""

    __slots__ = ("stream",)

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None, stall: float = math.inf,
                 min_rate: float = 0.0) -> None:
        super().__init__(sock, stall, min_rate)
        self.tls = True
        self.stream = trio.SSLStream(trio.SocketStream(trio.socket.from_stdlib_socket(sock)),
                                     context, server_side=server_side,
                                     server_hostname=server_hostname, https_compatible=True)

    async def handshake(self) -> None:
        """The TLS handshake now (a client's first step); errors as `OSError`."""
        try:
            await self.stream.do_handshake()
        except _GONE as e:
            raise ConnectionError(f"TLS handshake failed: {e.__cause__ or e}") from None

    async def receive(self, max_bytes: int = READ_BYTES) -> bytes:
        try:
            return bytes(await self.stream.receive_some(max_bytes))
        except _GONE:
            return b""

    def receive_nowait(self, max_bytes: int = READ_BYTES) -> bytes | None:
        return None  # TLS records: only the stream knows what is readable

    async def send_all(self, data: bytes, shield: bool = True) -> None:
        try:
            if self.stall == math.inf and self._by == math.inf:
                with trio.CancelScope(shield=shield):
                    await self.stream.send_all(data)
                self.sent += len(data)
                return
            # The TLS stream shows no partial progress: fed in pieces, each bounded (a
            # piece's write counts as a wait: the peer was behind if it took long).
            view = memoryview(data)
            for i in range(0, max(len(view), 1), TLS_PIECE):
                with self.waiting(shield, i):
                    await self.stream.send_all(view[i:i + TLS_PIECE])
            self.sent += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ConnectionError(str(e) or "TLS connection broken") from None

    def shutdown_write(self) -> bool:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # under the TLS records: see the docstring
        except OSError:
            return False
        return True

    async def aclose(self) -> None:
        with trio.move_on_after(CLOSE_NOTIFY_SECONDS, shield=True):  # a close_notify, bounded
            try:
                await self.stream.aclose()
            except _GONE:
                pass
        self.sock.close()


async def connect(host: str, port: int) -> socket.socket:
    """A connected, non-blocking TCP socket to `host:port` (each resolved address in
    turn); OSError when none answers. The caller bounds the time."""
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError = OSError(errno.EHOSTUNREACH, f"no address for {host}")
    for family, kind, proto, _, addr in infos:
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            await trio.socket.from_stdlib_socket(sock).connect(addr)
        except OSError as e:
            sock.close()
            last = e
            continue
        except BaseException:
            sock.close()
            raise
        nodelay(sock)
        return sock
    raise last
