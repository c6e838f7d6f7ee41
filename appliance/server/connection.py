"""One HTTP/1.1 connection of a listener, plain or TLS: every listener rule, written once.

Theory of operation: the accept loop (appliance/server/accept.py) runs `Conn.run` for each
connection it accepts: one task per connection, the app called in it, request after
request. The bytes move through a `Transport` (appliance/net/transport.py: the plain
socket itself, or trio's SSLStream over it), so plain and TLS connections run this same
code. Heads are parsed by appliance/h1/parse.py, bodies read by appliance/h1/body.py,
and whether the connection lives on is appliance/h1/state.py's table (`self.cycle`). A
refusal is answered in the API's shape (appliance/server/refuse.py) and the connection
closed, its read side drained a moment first so the answer is not lost to a reset.

The rules (numbers from `Limits`, appliance/server/limits.py, read per request: a reload
reaches kept-alive connections):
- Head deadline: `header_read_seconds` from the connection's start (the TLS handshake
  included), or from the first byte of a later request; a partial head is answered 408
  `request_timeout`, an idle connection closed. Between requests the connection waits
  `keep_alive` seconds at most; a drain (`Shared.terminating`) closes it, and an
  in-flight response ends with `connection: close`.
- A head over `max_head` bytes: 414 when its request line alone is too long, else 431.
- A declared Content-Length over `max_body_bytes`: 413 `body_too_large` at once (no
  `100 Continue`, nothing read).
- Body: read only when the app asks (`receive`), each read bounded by the body deadline
  (408 `request_timeout`); the bytes the apps hold count against the listener's
  `Budget` (503 `busy`). `Expect: 100-continue` is answered on the first body read, unless
  the response began or body bytes are already here.
- Once the body is read, `receive` waits for the client to go (EOF, an error, a write
  that failed) or for the response to end, and says `http.disconnect`, so a hub relaying a
  stream cancels the upstream when its client leaves. Pipelined bytes read meanwhile are
  kept for the next request (up to a bound).
- The connection serves the next request when `cycle.reusable`: both sides done, nobody
  said `close`, it was not HTTP/1.0, the server does not drain, fewer than
  `max_requests` were served. A body the app did not read but that is already here
  whole is skipped; one still owed closes the connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import trio

from appliance.bounds import echo_path
from appliance.h1.body import MIN_AVERAGE_CHUNK, BodyError, ChunkedBody
from appliance.h1.parse import MAX_TARGET, BadRequest, Head, parse_head
from appliance.h1.state import (
    BODY_END,
    BROKEN,
    DONE,
    IDLE,
    MUST_CLOSE,
    PEER_CLOSED,
    REQUEST,
    REQUEST_NO_BODY,
    SEND_BODY,
    SEND_RESPONSE,
)
from appliance.http.budget import BODY_BUDGET
from appliance.http.disconnect import HANGUP
from appliance.http.errors import ApiError
from appliance.net.transport import Transport
from appliance.server.hangups import watch_hangup
from appliance.server.limits import (
    BUSY_RETRY_AFTER,
    TRIM_AFTER_BYTES,
    Budget,
    Busy,
    Limits,
    LiveLimits,
    Refusal,
    RequestTimeout,
    trim,
)
from appliance.server.refuse import refusal_answer
from appliance.server.send import Sender

log = logging.getLogger("appliance.server.listener")

MAX_RECV = 65536
# Pipelined bytes held while a response is written; past this the connection stops reading.
MAX_PIPELINED = 64 * 1024
# A closing connection reads (and drops) what the client still sends for at most this long,
# so our last answer is not destroyed by a reset.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024
# A refusal to a client that does not read is not worth more than this.
WRITE_REFUSAL_SECONDS = 1.0
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


def _disconnect() -> dict[str, Any]:  # a fresh dict each time: an app may change what it got
    return {"type": "http.disconnect"}


class Shared:
    """What a listener's connections share: its rules (live: read per request, so a
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


class Slot:
    """A connection's place under `max_connections`: whether it serves a request now (a
    connection that does not may be shed), and the scope that sheds it."""

    __slots__ = ("in_request", "cancel")

    def __init__(self) -> None:
        self.in_request = False
        self.cancel = trio.CancelScope()


class Conn(Sender):
    """One connection (see the module's docstring)."""

    def __init__(self, transport: Transport, shared: Shared, slot: Slot) -> None:
        super().__init__(transport)
        self.shared = shared
        self.slot = slot
        self.buf = b""
        self.eof = False  # the client closed (or broke) its side
        self.requests = 0
        self.linger = False  # an answer refused the request: drain its read side before the close
        self._waiter: trio.CancelScope | None = None  # receive() waiting for the disconnect
        self._hangup: Callable[[], None] | None = None  # a HangupWatch watcher (watch)
        self.client = transport.peer()
        self.server = transport.local()
        self.scheme = "https" if transport.tls else "http"
        self._reset(None)

    def _reset(self, head: Head | None) -> None:
        self.head = head
        self.body_left = head.length if head is not None else 0
        self.chunks = (ChunkedBody(MIN_AVERAGE_CHUNK) if head is not None and head.chunked
                       else None)
        self.end_given = False  # the last http.request message went to the app
        self.bad: BadRequest | None = None
        self.held = 0
        self.reads = 0
        self.continued = False
        self.new_response(head.method if head is not None else "GET",
                          head.version if head is not None else "1.1")

    @property
    def body_ended(self) -> bool:
        return self.cycle.their != SEND_BODY

    def closing(self) -> bool:
        head, sh = self.head, self.shared
        return (head is None or not head.keep_alive or sh.terminating
                or self.requests >= sh.max_requests)

    def watch(self, fn: Callable[[], None]) -> Callable[[], None] | None:
        """appliance/http/disconnect.py's HangupWatch: `fn()` once when the client hangs up
        -- or when a write to it fails (it stopped reading, or the connection broke)."""
        stop = watch_hangup(self.transport.fileno(), fn)
        if stop is None:
            return None
        self._hangup = fn

        def unwatch() -> None:
            self._hangup = None
            stop()

        return unwatch

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
            self.cycle.next_cycle()
        if not self.eof and (self.linger or self.buf or not self.body_ended):
            await self._linger()

    async def _wait(self, deadline: float) -> bytes | None:
        """The next bytes (b"" at the end), or None past `deadline`."""
        with trio.CancelScope(deadline=deadline):
            data = await self.transport.receive(MAX_RECV)
            if not data:
                self._eof()
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
                    await self._too_large(bytes(buf))
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
                        await self._refuse_raw(408, "request_timeout",
                                               "request head not received in time")
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
            await self._too_large(self.buf[:end])
            return None
        raw, self.buf = self.buf[:end], self.buf[end + 4:]
        try:
            head = parse_head(raw)
        except BadRequest as e:
            await self._refuse_raw(e.status, "invalid_request", e.message, _path_of(raw))
            return None
        limit = sh.limits.max_body_bytes
        if limit and head.length > limit:  # said up front: refused before any of it is read
            await self._refuse_raw(413, "body_too_large",
                                   f"request body of {head.length} bytes is over the bound "
                                   f"of {limit}", _path_of(raw))
            return None
        return head

    async def _too_large(self, head: bytes) -> None:
        """A head over the bound: 414 when the request line alone is too long, else 431."""
        line_end = head.find(b"\r\n")
        if line_end < 0 or line_end > MAX_TARGET:
            await self._refuse_raw(414, "invalid_request", "request target too long",
                                   _path_of(head[:MAX_TARGET]))
        else:
            await self._refuse_raw(431, "invalid_request", "request head too large",
                                   _path_of(head[:line_end]))

    async def _refuse_raw(self, status: int, code: str, message: str, path: str = "/v1/",
                          retry_after: float | None = None) -> None:
        """Answer `status` (the head's path gives the API's shape; none: OpenAI's), then
        the connection closes."""
        self.linger = True
        if self.cycle.ours == SEND_RESPONSE and self.cycle.their == SEND_BODY:
            self.cycle.client(BROKEN)  # what the client sends now is not read
        answer = refusal_answer(path, ApiError(status, code, message, retry_after=retry_after))
        with trio.move_on_after(WRITE_REFUSAL_SECONDS) as cs:
            await self._write(answer, shield=False)
        if cs.cancelled_caught:  # a client that does not read: not worth more
            self.broken = True

    async def _serve(self, head: Head) -> bool:
        """One request; whether the connection may serve another."""
        sh = self.shared
        self._reset(head)
        has_body = head.chunked or head.length > 0
        self.cycle.client(REQUEST if has_body else REQUEST_NO_BODY)
        if not head.keep_alive:
            self.cycle.close()
        self.body_deadline = trio.current_time() + sh.limits.body_read_seconds
        target = head.target
        path, _, query = target.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": _ASGI, "http_version": head.version, "method": head.method,
            "scheme": self.scheme,
            "path": unquote(path.decode("ascii")) if b"%" in path else path.decode("ascii"),
            "raw_path": path, "query_string": query, "root_path": "", "headers": head.headers,
            "client": self.client, "server": self.server, "state": {},
            "extensions": {HANGUP: self, BODY_BUDGET: self},
        }
        self.slot.in_request = True
        try:
            await sh.app(scope, self.receive, self.send)
        except Refusal as e:
            await self._refuse(scope["path"], e)
        except Exception:
            log.exception("error in the app serving %s %s", head.method, echo_path(scope["path"]))
        finally:
            self.slot.in_request = False
            sh.budget.give(self.held)
            if self.held >= TRIM_AFTER_BYTES and sh.budget.held == 0:
                trim()
            self.stop_waiting()
        if self.bad is not None:
            if not self.framing:
                await self._refuse_raw(self.bad.status, "invalid_request", self.bad.message,
                                       scope["path"])
            return False
        if not self.framing:  # the app returned (or failed) before its answer: a 500
            self.started, self.status = True, 500
            self.head_headers = [(b"connection", b"close")]
            await self.send({"type": "http.response.body", "body": b""})
        elif not self.done:
            return False  # an answer cut short: only a close tells the client
        if self.closing():
            self.cycle.close()
        if self.eof or self.broken or not self.cycle.keep_alive:
            return False
        self._skip_unread_body()
        return self.cycle.reusable

    def _skip_unread_body(self) -> None:
        """Drop a body the app did not read if it is already here whole (the client is
        then DONE and the connection may serve the next request)."""
        if self.body_ended:
            return
        if self.chunks is not None:
            try:
                _chunks_feed(self.chunks, self.buf)
            except BadRequest:
                self.cycle.client(BROKEN)
                return
            if not self.chunks.done:
                return
            self.buf = self.chunks.leftover
        elif len(self.buf) >= self.body_left:
            self.buf = self.buf[self.body_left:]
            self.body_left = 0
        else:
            return
        self.cycle.client(BODY_END)

    async def _refuse(self, path: str, e: Refusal) -> None:
        retry_after: float | None = None
        if isinstance(e, Busy):
            b = self.shared.budget
            log.warning("refusing a request body: %d bytes of bodies held, the bound is %d",
                        b.held, b.limit)
            message = "the server holds too many request bodies now; retry shortly"
            retry_after = BUSY_RETRY_AFTER
        elif isinstance(e, RequestTimeout):
            message = (f"request body not received within "
                       f"{self.shared.limits.body_read_seconds:g} s")
        else:
            message = str(e) or e.code
        self.cycle.close()
        self.linger = True
        if self.framing:
            return  # the answer has begun: the close tells the client
        self.started, self.done, self.framing = True, True, "none"
        await self._refuse_raw(e.status, e.code, message, path, retry_after)

    async def _linger(self) -> None:
        """Close gently: our side first, then drop what the client still sends (bounded),
        so the last answer reaches it rather than a reset."""
        if not self.transport.shutdown_write():
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
                    return self._broken_body(e)
                self.buf = self.chunks.leftover  # b"" until the body's end: the rest is kept there
                if data or self.chunks.done:
                    if self.chunks.done:
                        self.cycle.client(BODY_END)
                    return self._deliver(data)
            elif self.buf:
                data = self.buf[:self.body_left]
                self.buf = self.buf[len(data):]
                self.body_left -= len(data)
                if self.body_left == 0:
                    self.cycle.client(BODY_END)
                return self._deliver(data)
            got = await self._read_body()
            if not got:  # the client left before the body's end: as h11 says, a 400
                return self._broken_body(BadRequest(400, "the request body ended early"))
            if self.chunks is None and len(got) <= self.body_left:
                self.body_left -= len(got)
                if self.body_left == 0:
                    self.cycle.client(BODY_END)
                return self._deliver(got)
            self.buf += got

    def _broken_body(self, e: BadRequest) -> dict[str, Any]:
        self.bad = e
        self.linger = True
        if self.cycle.their == SEND_BODY:
            self.cycle.client(BROKEN)
        return _disconnect()

    async def _read_body(self) -> bytes:
        self.reads += 1
        if self.reads == 1:  # the body most often followed its head: no wait for it
            data = self.transport.receive_nowait(MAX_RECV)
            if data is not None:
                return data or self._eof()
        data = await self._wait(self.body_deadline)
        if data is None:
            raise RequestTimeout()
        return data

    def _eof(self) -> bytes:
        if not self.eof:
            self.eof = True
            if self.cycle.their in (IDLE, DONE, MUST_CLOSE):  # (mid-body: the reader says so)
                self.cycle.client(PEER_CLOSED)
        return b""

    def hold(self, n: int) -> bool:
        """BodyBudget (http/budget.py): `n` more bytes held for this request, given back
        with its body when it ends; False when the listener's bound would be passed."""
        if not self.shared.budget.take(n):
            return False
        self.held += n
        return True

    def _deliver(self, data: bytes) -> dict[str, Any]:
        n = len(data)
        if n:
            if not self.shared.budget.take(n):
                raise Busy()
            self.held += n
        ended = self.body_ended
        if ended:
            self.end_given = True
        return {"type": "http.request", "body": data, "more_body": not ended}

    async def _wait_disconnect(self) -> dict[str, Any]:
        """The body is read: wait for the client to go or the response to end."""
        if self.done or self.eof:
            return _disconnect()
        transport = self.transport
        extra = bytearray()  # pipelined bytes (grown in place, however they trickle in)
        try:
            with trio.CancelScope() as cs:
                self._waiter = cs
                while True:
                    if len(self.buf) + len(extra) >= MAX_PIPELINED:
                        await trio.sleep_forever()  # read no further until the answer is out
                    data = await transport.receive(MAX_RECV)
                    if not data:
                        self._eof()
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
        if self.broken and self._hangup is not None:  # a watcher waits on the socket alone
            fn, self._hangup = self._hangup, None
            fn()


def _path_of(raw: bytes) -> str:
    """The request target in a raw head (for the error's API shape), "/" when there is none."""
    parts = raw.split(b" ", 2)
    return parts[1].decode("latin-1") if len(parts) >= 2 else "/"
