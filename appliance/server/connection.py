"""A lean HTTP/1.1 server for the plain-TCP connections of our listeners.

Theory of operation: hypercorn costs about half a millisecond of CPU per request (a task
per request, an event queue each way, h11's state machine, trio's socket wrapper). For
a plain (non-TLS) connection, appliance/server/listener.py runs `Conn.run` instead: one task
per connection, and the app is called in it, request after request. The connection is
the socket itself (`recv`/`send` on the stdlib socket, trio only to wait while it would
block, as appliance/server/fastio.py does); heads and chunked bodies are parsed by
appliance/h1/parse.py (strict; a refusal is answered in the API's shape and the
connection closed, read side drained a moment first so the answer is not lost to a
reset). The listener's rules are kept here natively (appliance/server/listener.py names them):

- Head deadline: `header_read_seconds` from the connection's start, or from the first
  byte of a later request; a partial head is answered 408, an idle connection closed.
  Between requests the connection waits `keep_alive` seconds at most; a drain
  (`Shared.terminating`) closes it, and an in-flight response ends with `connection:
  close`.
- Body: read only when the app asks (`receive`), each read bounded by the body deadline
  (408 `request_timeout`); the bytes the apps hold count against the listener's
  `Budget` (503 `busy`). `Expect: 100-continue` is answered on the first body read.
- Once the body is read, `receive` waits for the client to go (EOF, an error, a write
  that failed) or for the response to end, and says `http.disconnect` -- what hypercorn
  says, so a hub relaying a stream cancels the upstream when its client leaves.
  Pipelined bytes read meanwhile are kept for the next request (up to a bound).
- A response is written by `Sender` (appliance/server/send.py): a small answer in one `send`,
  a streamed one chunked.
- The connection is kept for the next request unless either side said `close`, it was
  HTTP/1.0, a body was left unread (and not already buffered whole), the response did
  not end cleanly, or the server drains.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import trio

from appliance.h1.chunked import BodyError, ChunkedBody
from appliance.h1.head import refusal
from appliance.h1.parse import BadRequest, Head, parse_head
from appliance.http.errors import ApiError, api_of, render
from appliance.server.fastio import DIRECT_KEY, recv_some
from appliance.server.listener import (
    BUSY_RETRY_AFTER,
    TRIM_AFTER_BYTES,
    Budget,
    Busy,
    Limits,
    LiveLimits,
    Refusal,
    RequestTimeout,
    _trim,
)
from appliance.server.send import Sender

log = logging.getLogger("appliance.server.listener")

MAX_RECV = 65536
# Pipelined bytes held while a response is written; past this the connection stops reading.
MAX_PIPELINED = 64 * 1024
# A closing connection reads (and drops) what the client still sends for at most this long,
# so our last answer is not destroyed by a reset.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024
_WRITE_408_SECONDS = 1.0
_ASGI = {"spec_version": "2.1", "version": "3.0"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def _chunks_feed(body: ChunkedBody, data: bytes) -> bytes:
    """The payload of a chunked request body in `data` (the reader keeps what it needs of
    a partial line); broken framing is a 400, at once even after some payload."""
    try:
        payload = body.feed(data)
        if body.error is not None:
            raise body.error
    except BodyError as e:
        raise BadRequest(400, str(e)) from None
    return payload


async def _recv(sock: socket.socket) -> bytes:
    """The next bytes from the client; b"" at its end or when its connection broke."""
    try:
        return await recv_some(sock, MAX_RECV)
    except OSError:
        return b""


def _disconnect() -> dict[str, Any]:  # a fresh dict each time: an app may change what it got
    return {"type": "http.disconnect"}


class Shared:
    """What a listener's lean connections share: its rules (live: read per request, so a
    reload reaches kept-alive connections), its budget, its drain."""

    def __init__(self, app: Callable[..., Any], limits: LiveLimits, budget: Budget, *,
                 keep_alive: float, max_head: int, max_requests: int) -> None:
        self.app = app
        self.live = limits
        self.budget = budget
        self.keep_alive = keep_alive
        self.max_head = max_head
        self.max_requests = max_requests
        self.terminating = False

    @property
    def limits(self) -> Limits:
        return self.live.now


class Conn(Sender):
    """One plain connection (see the module's docstring)."""

    def __init__(self, sock: socket.socket, shared: Shared, guard: Any) -> None:
        super().__init__(sock)
        self.shared = shared
        self.guard = guard  # appliance.server.listener._Guard: in_request (shedding)
        self.buf = b""
        self.eof = False  # the client closed (or broke) its side
        self.requests = 0
        self.linger = False  # an answer refused the request: drain its read side before the close
        self._waiter: trio.CancelScope | None = None  # receive() waiting for the disconnect
        try:
            peer = sock.getpeername()
            here = sock.getsockname()
        except OSError:
            peer = here = None
        inet = sock.family in (socket.AF_INET, socket.AF_INET6)
        self.client = (peer[0], peer[1]) if inet and peer else None
        self.server = (here[0], here[1]) if inet and here else None
        self._reset(None)

    def _reset(self, head: Head | None) -> None:
        self.head = head
        self.body_left = head.length if head is not None else 0
        self.chunks = ChunkedBody() if head is not None and head.chunked else None
        self.body_ended = head is None or (not head.chunked and head.length == 0)
        self.end_given = False  # the last http.request message went to the app
        self.bad: BadRequest | None = None
        self.held = 0
        self.reads = 0
        self.continued = False
        self.new_response(head.method if head is not None else "GET",
                          head.version if head is not None else "1.1")

    def closing(self) -> bool:
        head, sh = self.head, self.shared
        return (head is None or not head.keep_alive or sh.terminating
                or self.requests >= sh.max_requests)

    # --- the connection ----------------------------------------------------------------------

    async def run(self) -> None:
        started = trio.current_time()
        while True:
            head = await self._read_head(started if self.requests == 0 else None)
            if head is None:
                break
            self.requests += 1
            if not await self._serve(head):
                break
        if not self.eof and (self.linger or self.buf or not self.body_ended):
            await self._linger()

    async def _wait(self, deadline: float) -> bytes | None:
        """The next bytes (b"" at the end), or None past `deadline`."""
        sock = self.sock
        with trio.CancelScope(deadline=deadline):
            data = await _recv(sock)
            if not data:
                self.eof = True
            return data
        return None

    async def _read_head(self, started: float | None) -> Head | None:
        sh = self.shared
        head_seconds = sh.limits.header_read_seconds
        deadline = (started + head_seconds if started is not None
                    else trio.current_time() + head_seconds if self.buf else None)
        buf: bytes | bytearray = self.buf
        scan = 0
        try:
            while True:
                end = buf.find(b"\r\n\r\n", scan)
                if end >= 0:
                    break
                scan = max(0, len(buf) - 3)  # a trickled head is searched once, not per byte
                if len(buf) > sh.max_head:
                    await self._refuse_raw(431, "request head too large")
                    return None
                if sh.terminating and not buf:
                    return None
                if deadline is None:  # kept alive, idle: its bound; a first byte starts the head's
                    data = await self._wait(trio.current_time() + sh.keep_alive)
                    if data:  # (the limits now: a reload may have come meanwhile)
                        deadline = trio.current_time() + sh.limits.header_read_seconds
                else:
                    data = await self._wait(deadline)
                    if data is None and buf:
                        await self._refuse_raw(408, "request head not received in time")
                if not data:
                    return None
                if not buf:
                    buf = data  # most heads come whole: no copy
                else:
                    if isinstance(buf, bytes):
                        buf = bytearray(buf)  # a trickled one grows in place
                    buf += data
        finally:
            self.buf = bytes(buf)
        if end > sh.max_head:
            await self._refuse_raw(431, "request head too large")
            return None
        raw, self.buf = self.buf[:end], self.buf[end + 4:]
        try:
            return parse_head(raw)
        except BadRequest as e:
            path = raw.split(b" ", 2)[1] if raw.count(b" ") >= 2 else b"/"
            await self._refuse_raw(e.status, e.message, path.decode("latin-1"))
            return None

    async def _refuse_raw(self, status: int, message: str, path: str = "/v1/") -> None:
        self.linger = True
        code = "request_timeout" if status == 408 else "invalid_request"
        r = render(ApiError(status, code, message), api_of(path))
        with trio.move_on_after(_WRITE_408_SECONDS) as cs:
            await self._write(refusal(r.status, r.body), shield=False)
        if cs.cancelled_caught:  # a client that does not read: not worth more
            self.broken = True

    async def _serve(self, head: Head) -> bool:
        """One request; whether the connection may serve another."""
        sh = self.shared
        self._reset(head)
        self.body_deadline = trio.current_time() + sh.limits.body_read_seconds
        target = head.target
        path, _, query = target.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": _ASGI, "http_version": head.version, "method": head.method,
            "scheme": "http",
            "path": unquote(path.decode("ascii")) if b"%" in path else path.decode("ascii"),
            "raw_path": path, "query_string": query, "root_path": "", "headers": head.headers,
            "client": self.client, "server": self.server, "state": {DIRECT_KEY: self},
            "extensions": {},
        }
        self.guard.in_request = True
        try:
            await sh.app(scope, self.receive, self.send)
        except Refusal as e:
            await self._refuse(scope["path"], e)
        except Exception:
            log.exception("error in the app serving %s %s", head.method, scope["path"])
        finally:
            self.guard.in_request = False
            sh.budget.give(self.held)
            if self.held >= TRIM_AFTER_BYTES and sh.budget.held == 0:
                _trim()
            self.stop_waiting()
        if self.bad is not None:
            if not self.framing:
                await self._refuse_raw(self.bad.status, self.bad.message, scope["path"])
            return False
        if not self.framing:  # the app returned (or failed) before its answer: hypercorn's 500
            self.started, self.status = True, 500
            self.head_headers = [(b"connection", b"close")]
            await self.send({"type": "http.response.body", "body": b""})
        elif not self.done:
            return False  # an answer cut short: only a close tells the client
        if self.close_after or self.broken or self.eof or sh.terminating:
            return False
        return self._skip_unread_body()

    def _skip_unread_body(self) -> bool:
        """Drop a body the app did not read if it is already here whole; else False."""
        if self.body_ended:
            return True
        if self.chunks is not None:
            try:
                _chunks_feed(self.chunks, self.buf)
            except BadRequest:
                return False
            if not self.chunks.done:
                return False
            self.buf = self.chunks.leftover
            return True
        if len(self.buf) < self.body_left:
            return False
        self.buf = self.buf[self.body_left:]
        return True

    async def _refuse(self, path: str, e: Refusal) -> None:
        if isinstance(e, Busy):
            b = self.shared.budget
            log.warning("refusing a request body: %d bytes of bodies held, the bound is %d",
                        b.held, b.limit)
            err = ApiError(e.status, e.code,
                           "the server holds too many request bodies now; retry shortly",
                           retry_after=BUSY_RETRY_AFTER)
        elif isinstance(e, RequestTimeout):
            err = ApiError(e.status, e.code, f"request body not received within "
                           f"{self.shared.limits.body_read_seconds:g} s")
        else:
            err = ApiError(e.status, e.code, str(e) or e.code)
        self.close_after = self.linger = True
        if self.framing:
            return  # the answer has begun: the close tells the client
        self.started = False
        r = render(err, api_of(path), [(b"connection", b"close")])
        await self.send({"type": "http.response.start", "status": r.status, "headers": r.headers})
        await self.send({"type": "http.response.body", "body": r.body})

    async def _linger(self) -> None:
        """Close gently: our side first, then drop what the client still sends (bounded),
        so the last answer reaches it rather than a reset."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        dropped = 0
        with trio.move_on_after(LINGER_SECONDS):
            while dropped < LINGER_BYTES:
                data = await self._wait(float("inf"))
                if not data:
                    return
                dropped += len(data)

    # --- the app's receive ---------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if self.bad is not None or self.broken:
            return _disconnect()
        if not self.body_ended:
            return await self._body()
        if not self.end_given:
            self.end_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await self._wait_disconnect()

    async def _body(self) -> dict[str, Any]:
        if self.head is not None and self.head.expect_continue and not self.continued:
            self.continued = True
            if not self.started and not self.buf:
                await self._write(_CONTINUE)
        while True:
            if self.chunks is not None:
                try:
                    data = _chunks_feed(self.chunks, self.buf)
                except BadRequest as e:
                    self.bad = e
                    self.linger = True
                    return _disconnect()
                self.buf = self.chunks.leftover  # b"" until the body's end: the rest is kept there
                if data or self.chunks.done:
                    self.body_ended = self.chunks.done
                    return self._deliver(data)
            elif self.buf:
                data = self.buf[:self.body_left]
                self.buf = self.buf[len(data):]
                self.body_left -= len(data)
                self.body_ended = self.body_left == 0
                return self._deliver(data)
            got = await self._read_body()
            if not got:  # the client left (eof set) before the body's end: as h11 says, a 400
                self.bad = BadRequest(400, "the request body ended early")
                return _disconnect()
            if self.chunks is None and len(got) <= self.body_left:
                self.body_left -= len(got)
                self.body_ended = self.body_left == 0
                return self._deliver(got)
            self.buf += got

    async def _read_body(self) -> bytes:
        self.reads += 1
        if self.reads == 1:  # the body most often followed its head: no wait for it
            try:
                return self.sock.recv(MAX_RECV) or self._eof()
            except BlockingIOError:
                pass
            except OSError:
                return self._eof()
        data = await self._wait(self.body_deadline)
        if data is None:
            raise RequestTimeout()
        return data

    def _eof(self) -> bytes:
        self.eof = True
        return b""

    def _deliver(self, data: bytes) -> dict[str, Any]:
        n = len(data)
        if n:
            if not self.shared.budget.take(n):
                raise Busy()
            self.held += n
        if self.body_ended:
            self.end_given = True
        return {"type": "http.request", "body": data, "more_body": not self.body_ended}

    async def _wait_disconnect(self) -> dict[str, Any]:
        """The body is read: wait for the client to go or the response to end."""
        if self.done or self.eof:
            return _disconnect()
        sock = self.sock
        extra = bytearray()  # pipelined bytes (grown in place, however they trickle in)
        try:
            with trio.CancelScope() as cs:
                self._waiter = cs
                while True:
                    if len(self.buf) + len(extra) >= MAX_PIPELINED:
                        await trio.sleep_forever()  # read no further until the answer is out
                    data = await _recv(sock)
                    if not data:
                        self.eof = True
                        break
                    extra += data
        finally:
            self._waiter = None
            if extra:
                self.buf += bytes(extra)
        return _disconnect()

    def stop_waiting(self) -> None:
        if self._waiter is not None:
            self._waiter.cancel()
