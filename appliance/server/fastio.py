"""A relayed stream's fast path: one wait and one syscall per read, one syscall per write.

Theory of operation: a relayed token costs the hub (and the node) one read from the peer
and one write to the client. bench/streams.py --profile showed where ~100-180 us of CPU
per paced event went (docs/streams-profile.md): the write crossed five layers (our
request-id and guard wrappers, hypercorn's HTTPStream.app_send, its H11Protocol, h11's
chunked writer, TCPServer.protocol_send), and trio's socket calls pay a scheduler round
trip around every call (`_nonblocking_helper`: a checkpoint before, a cancel-shielded
checkpoint after a success) -- a read is a failed recv, an epoll re-arm, a park, the
recv, a reschedule; a write is a send and a reschedule. This module keeps the first and
the last of those only:

- `recv_some` (reads from a node or an engine, appliance/client/upstream.py): wait until the
  socket is readable (the one checkpoint: cancellation and deadlines work as before),
  then recv on the plain socket. A stream whose last read emptied the socket is not
  readable yet, so a first, failing recv would be a syscall for nothing.
- `DirectBody` (writes to the client): once hypercorn has sent the response head with
  chunked framing on an HTTP/1.1 connection, each later body message is, on the wire,
  `<hex size>\\r\\n<data>\\r\\n`; h11's ChunkedWriter keeps no count, so frames we write
  between its own are indistinguishable from its own. They go out with a plain send
  while the connection's send lock is free (no checkpoint between the look and the
  send: no other writer can start), under the lock when they must wait; only a full
  socket buffer waits (shielded, as hypercorn's own writes are: a write cut
  half-way would leave the client's connection in an unknown state). The response still
  ends through ASGI (`more_body: False`: h11 writes the last chunk, hypercorn's
  keep-alive bookkeeping runs as before).

The listener (appliance/server/listener.py) puts the connection's TCPServer in the request's
`state` under DIRECT_KEY -- or, on a plain connection, the lean server's `Conn`
(appliance/server/connection.py), which says it explicitly: `chunked_socket()` returns a
`ChunkedSocket` (send lock, socket, and the response head it has not written yet, sent
with the first chunk) when the body is chunked on a plain socket. `DirectBody.open`
returns None -- use ASGI as before -- for anything else: HTTP/2, HTTP/1.0, a sized
(content-length) response, TLS (the write goes through the TLS stream then, still
skipping the ASGI layers), no server in state. A
client gone mid-write makes `write` return False: the caller sends that chunk, and the
rest, through ASGI, where hypercorn meets the closed connection and tells the app
(`http.disconnect`) exactly as before.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, NamedTuple

import trio

DIRECT_KEY = "appliance.direct"


def plain_socket(stream: Any) -> socket.socket | None:
    """The OS socket under a plain trio TCP stream (through the listener's guard), or
    None (TLS, anything else)."""
    s = getattr(stream, "_inner", stream)  # appliance.server.listener._GuardedStream
    if not isinstance(s, trio.SocketStream):
        return None
    sock = getattr(s.socket, "_sock", None)  # trio's socket wraps the stdlib one
    return sock if isinstance(sock, socket.socket) else None


async def recv_some(sock: socket.socket, max_bytes: int) -> bytes:
    """Like trio's receive_some on `sock` (b"" at the end of the stream; OSError when it
    broke), with one checkpoint: the wait."""
    while True:
        await trio.lowlevel.wait_readable(sock)
        try:
            return sock.recv(max_bytes)
        except BlockingIOError:
            continue


class ChunkedSocket(NamedTuple):
    """A server's word that this response's body is chunked on a plain socket: the
    connection's send lock, the socket, and `head()` -- the response head not written yet
    (b"" once it is), to go out with the first chunk."""

    lock: trio.Lock
    sock: socket.socket
    head: Callable[[], bytes]


class DirectBody:
    """A streamed body's chunks, written straight to the client's connection."""

    __slots__ = ("_lock", "_stream", "_sock", "_head", "broken")

    def __init__(self, server: Any) -> None:
        self._sock: socket.socket | None
        self._head: Callable[[], bytes] | None
        self._stream: Any
        if isinstance(server, ChunkedSocket):
            self._lock, self._sock, self._head = server.lock, server.sock, server.head
            self._stream = None
        else:
            self._lock = server.send_lock
            self._stream = server.stream
            self._sock = plain_socket(server.stream)
            self._head = None
        self.broken = False

    @classmethod
    def open(cls, scope: dict[str, Any]) -> DirectBody | None:
        """A direct writer for this response's body, or None (then use ASGI). Call it
        after `http.response.start` went out through ASGI."""
        if scope.get("http_version") != "1.1":
            return None
        server = (scope.get("state") or {}).get(DIRECT_KEY)
        if server is None:
            return None
        lean = getattr(server, "chunked_socket", None)  # appliance/server/connection.py
        if lean is not None:
            target = lean()
            return None if target is None else cls(target)
        # ProtocolWrapper -> H11Protocol -> h11.Connection -> its writer
        proto = getattr(getattr(server, "protocol", None), "protocol", None)
        writer = getattr(getattr(proto, "connection", None), "_writer", None)
        if type(writer).__name__ != "ChunkedWriter":
            return None  # a sized body, a close-delimited HTTP/1.0 one, not h11
        return cls(server)

    async def write(self, data: bytes) -> bool:
        """One chunk on the wire; False (and nothing more is written) once the client is gone."""
        if self.broken:
            return False
        if not data:
            return True
        frame = b"%x\r\n%b\r\n" % (len(data), data)
        lock = self._lock
        # The lock is taken only to wait: a write that does not wait has no checkpoint, so
        # no other task can run (and write) while it is on the wire -- trio is cooperative.
        held = False
        if lock.locked():
            with trio.CancelScope(shield=True):  # a cut interrupts reads, never a write
                await lock.acquire()
            held = True
        sock = self._sock
        try:
            if self._head is not None:
                frame = self._head() + frame
                self._head = None
            if sock is None:
                if not held:
                    lock.acquire_nowait()  # free: no checkpoint since it was seen free
                    held = True
                with trio.CancelScope(shield=True):
                    await self._stream.send_all(frame)
            else:
                try:
                    n = sock.send(frame)  # the whole frame, unless the buffer is full
                except BlockingIOError:
                    n = 0
                if n < len(frame):
                    if not held:
                        lock.acquire_nowait()
                        held = True
                    await send_all(sock, frame[n:])
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.broken = True
            return False
        finally:
            if held:
                lock.release()
        return True


async def send_all(sock: socket.socket, data: bytes, shield: bool = True) -> None:
    """All of `data` on `sock` (OSError when the peer is gone); waits only while its buffer
    is full -- shielded unless told otherwise: a write cut half-way leaves the client's
    connection in an unknown state."""
    view = memoryview(data)
    while view:
        try:
            n = sock.send(view)
        except BlockingIOError:
            with trio.CancelScope(shield=shield):
                await trio.lowlevel.wait_writable(sock)
            continue
        view = view[n:]
