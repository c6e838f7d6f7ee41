"""The send side of a lean HTTP/1.1 connection (appliance/server/connection.py): ASGI response
messages to bytes on the client's socket.

Theory of operation: `http.response.start` is only noted; the head is built
(appliance/h1/head.py) with the first body message, so a small answer is one `send`
of head + body with a content-length, and a streamed one (`more_body`) is chunked
(HTTP/1.1) or delimited by the close (HTTP/1.0); HEAD, 1xx, 204 and 304 carry no body.
Writes go straight to the socket (a plain `send`; trio only to wait while its buffer is
full, shielded as hypercorn's writes are: a write cut half-way leaves the client's
connection unknown), under the connection's lock. A streamed body may also be written by
`DirectBody` (appliance/server/fastio.py) through `chunked_socket`: the lock, the socket
and the head not yet sent, which goes out with the first chunk. A write that fails marks
the connection `broken`: later writes are dropped and the receive side says
`http.disconnect` (`stop_waiting`). The connection says when it must close after this
answer (`closing`).
"""

from __future__ import annotations

import socket
from typing import Any

import trio

from appliance.h1.head import response_head
from appliance.server.fastio import ChunkedSocket, send_all


class Sender:
    """One connection's response side; `new_response` before each request."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = trio.Lock()
        self.broken = False  # a write failed
        self.new_response("GET", "1.1")

    def new_response(self, method: str, version: str) -> None:
        self.method = method
        self.version = version
        self.started = False
        self.status = 0
        self.head_headers: list[tuple[bytes, bytes]] = []
        self.pending = b""  # the response head, not written yet
        self.framing = ""  # "sized", "chunked", "close", "none"
        self.out_left = 0
        self.done = False
        self.close_after = False

    def closing(self) -> bool:
        """Whether the connection ends after this answer (the connection decides)."""
        return False

    def stop_waiting(self) -> None:
        """The answer ended or the client is gone (the receive side listens)."""

    async def send(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == "http.response.body":
            if not self.started:
                raise RuntimeError("http.response.body before http.response.start")
            if self.done:
                return
            more = msg.get("more_body", False)
            body = msg.get("body", b"")
            if not self.framing:
                self._frame(body, more)
            await self._body_out(body, more)
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("the response has already started")
            self.started = True
            self.status = int(msg["status"])
            self.head_headers = msg.get("headers") or []
        # other messages (trailers, push, early hints) mean nothing on HTTP/1.1 here

    def _frame(self, body: bytes, more: bool) -> None:
        """Decides the body's framing and builds the head (in `pending`)."""
        f = response_head(self.status, self.head_headers, method=self.method,
                          version=self.version, body=body, more=more, close=self.closing())
        self.pending, self.framing, self.out_left = f.head, f.framing, f.length
        self.close_after = self.close_after or f.close

    def _take_head(self) -> bytes:
        head, self.pending = self.pending, b""
        return head

    async def _body_out(self, body: bytes, more: bool) -> None:
        framing = self.framing
        if framing == "chunked":
            if body:
                data = b"%x\r\n%b\r\n" % (len(body), body)
                if not more:
                    data += b"0\r\n\r\n"
            else:
                data = b"" if more else b"0\r\n\r\n"
        elif framing == "none":
            data = b""
        else:
            data = body
            if framing == "sized":
                if len(body) > self.out_left:
                    data = body[:self.out_left]
                    self.close_after = True  # the app wrote more than it said: cut
                self.out_left -= len(data)
                if not more and self.out_left:
                    self.close_after = True  # ... or less
        if not more:
            self.done = True
        if self.pending:
            data = self._take_head() + data
        if data:
            await self._write(data)
        if not more:
            self.stop_waiting()

    def chunked_socket(self) -> ChunkedSocket | None:
        """For DirectBody (appliance/server/fastio.py): the socket, if this response's body is
        chunked on it. Decides the framing now (chunked) unless a body went out already."""
        if not self.started or self.done or self.broken:
            return None
        if not self.framing:
            self._frame(b"", True)
        if self.framing != "chunked":
            return None
        return ChunkedSocket(self.lock, self.sock, self._take_head)

    async def _write(self, data: bytes, shield: bool = True) -> None:
        """All of `data`, waiting only while the socket's buffer is full -- shielded unless
        told otherwise: a write cut half-way leaves the client's connection unknown."""
        if self.broken:
            return
        sock = self.sock
        lock = self.lock
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            await send_all(sock, data, shield)
        except OSError:
            self.broken = True
            self.stop_waiting()  # receive() says http.disconnect now
        finally:
            lock.release()
