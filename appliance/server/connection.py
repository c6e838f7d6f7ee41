"""One HTTP/1.1 connection of a listener, plain or TLS: every listener rule, written once.

Owns a connection's life: the accept loop (appliance/server/serve.py) runs `Conn.run`,
one task per connection, request after request; bytes move through a `Transport`
(appliance/net/transport.py: the socket, or trio's SSLStream over it), heads are parsed
by appliance/h1/parse.py, bodies read by the receive side (`rx`, receive.py), answers
written by the send side (`tx`, send.py), and whether the connection lives on is
appliance/h1/state.py's table (`cycle`). Refusals are answered in the API's shape
(refuse.py), then the connection closes, its read side drained a moment first.
The rules (`Limits`, limits.py, read per request: a reload reaches kept-alive ones):
- Head deadline `header_read_seconds` from the connection's start (TLS handshake
  included) or a later request's first byte: a partial head is 408, an idle connection
  closed; `keep_alive` seconds between requests; a drain closes idle connections, and an
  answer in flight ends with `connection: close`.
- A head over `max_head`: 414 when its request line alone is too long, else 431; a
  declared Content-Length over `max_body_bytes`: 413 at once (no `100 Continue`).
- What the receive side raises (`Busy` 503, `RequestTimeout` 408) or notes (a broken
  body: 400) is answered here.
- The next request is served when `cycle.reusable`; a body the app did not read but that
  is already here whole is skipped, one still owed closes (its answer says so).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import trio

from appliance.bounds import echo_path
from appliance.h1.parse import MAX_TARGET, BadRequest, Head, parse_head
from appliance.h1.state import (
    BROKEN,
    DONE,
    ERROR,
    NO_BODY,
    REQUEST,
    REQUEST_NO_BODY,
    SEND_BODY,
    SEND_RESPONSE,
    Cycle,
)
from appliance.http.asgi import BODY_BUDGET
from appliance.http.errors import ApiError
from appliance.http.stream import HANGUP
from appliance.net.transport import Transport
from appliance.server.limits import TRIM_AFTER_BYTES, Busy, ListenerRefusal, LiveLimits, trim
from appliance.server.receive import Budget, Receiver
from appliance.server.refuse import refusal_answer
from appliance.server.send import Hangups, Sender

log = logging.getLogger(__name__)

# A closing connection reads (and drops) what the client still sends for at most this long,
# so our last answer is not destroyed by a reset.
LINGER_SECONDS = 2.0
LINGER_BYTES = 1024 * 1024
# A refusal to a client that does not read is not worth more than this.
WRITE_REFUSAL_SECONDS = 1.0
_ASGI = {"spec_version": "2.1", "version": "3.0"}


class Shared:
    """What a listener's connections share: its rules (live: read per request, so a
    reload reaches kept-alive connections), its budget, its hang-up watcher, its drain."""

    def __init__(self, app: Callable[..., Any], limits: LiveLimits, budget: Budget, *,
                 keep_alive: float, max_head: int, max_requests: int,
                 hangups: Hangups | None = None) -> None:
        self.app = app
        self.live = limits
        self.budget = budget
        self.keep_alive = keep_alive
        self.max_head = max_head
        self.max_requests = max_requests
        self.hangups = hangups
        self.terminating = False


class Conn:
    """One connection (see the module's docstring): a receive side (`rx`) and a send side
    (`tx`) over one table (`cycle`); to the app, the ASGI extensions HANGUP (`tx`) and
    BODY_BUDGET (`rx`). To the accept loop it is also a place under `max_connections`:
    whether it serves a request now (`in_request`: one that does not may be shed), and the
    scope that sheds it (`cancel`)."""

    def __init__(self, transport: Transport, shared: Shared) -> None:
        self.transport = transport
        self.cycle = Cycle()
        self.tx = Sender(transport, self.cycle, closing=self.closing, hangups=shared.hangups)
        self.rx = Receiver(transport, shared.budget, self.tx)
        self.tx.answered = self.rx.stop_waiting  # the answer ended: receive() stops waiting
        self.shared = shared
        self.in_request = False
        self.cancel = trio.CancelScope()
        self.requests = 0
        sock = transport.sock  # the peer's and our (host, port): the scope's client, server
        self.client: tuple[str, int] | None = None  # (None: not IP, or it cannot tell)
        self.server: tuple[str, int] | None = None
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                self.client = sock.getpeername()[:2]
            except OSError:  # gone already
                pass
            try:
                self.server = sock.getsockname()[:2]
            except OSError:
                pass
        self.scheme = "https" if transport.tls else "http"

    def closing(self) -> bool:
        """Whether the connection ends after this answer -- said in its head
        (`connection: close`) and obeyed. An answer that begins while the request's body is
        still owed (a refusal before reading it) closes: a body not here whole is never
        skipped, and a head that said keep-alive would have the client send its next
        request into our close."""
        head, sh = self.rx.head, self.shared
        return (head is None or not head.keep_alive or sh.terminating
                or self.requests >= sh.max_requests
                or (self.cycle.their == SEND_BODY and self.rx.body_to_come()))

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
        cycle = self.cycle
        if not cycle.eof and (cycle.linger or self.rx.buf or cycle.their == SEND_BODY):
            await self._linger()

    async def _read_head(self, started: float | None) -> Head | None:
        sh = self.shared
        head_seconds = sh.live.now.header_read_seconds
        deadline = (started + head_seconds if started is not None
                    else trio.current_time() + head_seconds if self.rx.buf else None)
        buf: bytes | bytearray = self.rx.buf
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
                    data = await self.rx._wait(trio.current_time() + sh.keep_alive)
                    if data:  # (the limits now: a reload may have come meanwhile)
                        deadline = trio.current_time() + sh.live.now.header_read_seconds
                else:
                    data = await self.rx._wait(deadline)
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
            self.rx.buf = bytes(buf)
        if end > sh.max_head:
            await self._too_large(self.rx.buf[:end])
            return None
        raw, self.rx.buf = self.rx.buf[:end], self.rx.buf[end + 4:]
        try:
            head = parse_head(raw)
        except BadRequest as e:
            await self._refuse_raw(e.status, "invalid_request", e.message, _path_of(raw))
            return None
        lim = sh.live.now  # the largest body it may declare (0: no bound)
        limit = (lim.max_upload_bytes if lim.upload_paths
                 and head.target.partition(b"?")[0] in lim.upload_paths else lim.max_body_bytes)
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
        self.cycle.linger = True
        if self.cycle.ours == SEND_RESPONSE and self.cycle.their == SEND_BODY:
            self.cycle.client(BROKEN)  # what the client sends now is not read
        answer = refusal_answer(path, ApiError(status, code, message, retry_after=retry_after))
        with trio.move_on_after(WRITE_REFUSAL_SECONDS) as cs:
            await self.tx.write(answer, shield=False)
        if cs.cancelled_caught:  # a client that does not read: not worth more
            self.tx.abandon()

    async def _serve(self, head: Head) -> bool:
        """One request; whether the connection may serve another."""
        sh = self.shared
        self.rx.new_request(head)
        self.tx.new_response(head.method, head.version)
        has_body = head.chunked or head.length > 0
        self.cycle.client(REQUEST if has_body else REQUEST_NO_BODY)
        if not head.keep_alive:
            self.cycle.close()
        self.rx.body_seconds = sh.live.now.body_read_seconds
        self.rx.body_deadline = trio.current_time() + self.rx.body_seconds
        target = head.target
        path, _, query = target.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http", "asgi": _ASGI, "http_version": head.version, "method": head.method,
            "scheme": self.scheme,
            "path": unquote(path.decode("ascii")) if b"%" in path else path.decode("ascii"),
            "raw_path": path, "query_string": query, "root_path": "", "headers": head.headers,
            "client": self.client, "server": self.server, "state": {},
            "extensions": {HANGUP: self.tx, BODY_BUDGET: self.rx},
        }
        self.in_request = True
        try:
            await sh.app(scope, self.rx.receive, self.tx.send)
        except ListenerRefusal as e:
            await self._refuse(scope["path"], e)
        except Exception:
            log.exception("error in the app serving %s %s", head.method, echo_path(scope["path"]))
        finally:
            self.in_request = False
            sh.budget.give(self.rx.held)
            if self.rx.held >= TRIM_AFTER_BYTES and sh.budget.held == 0:
                trim()
            self.rx.stop_waiting()
        cycle = self.cycle
        if self.rx.bad is not None:
            if not cycle.framing:
                await self._refuse_raw(self.rx.bad.status, "invalid_request", self.rx.bad.message,
                                       scope["path"])
            return False
        if not cycle.framing:  # the app returned (or failed) before its answer: a 500
            self.tx.started, self.tx.status = True, 500
            self.tx.head_headers = [(b"connection", b"close")]
            await self.tx.send({"type": "http.response.body", "body": b""})
        elif not cycle.sent_end:
            return False  # an answer cut short: only a close tells the client
        if self.closing():
            cycle.close()
        if cycle.eof or cycle.ours == ERROR or not cycle.keep_alive:
            return False
        if cycle.their == SEND_BODY:
            self.rx._skip_unread_body()
        return cycle.their == DONE and cycle.ours == DONE  # the table's `reusable`

    async def _refuse(self, path: str, e: ListenerRefusal) -> None:
        if isinstance(e, Busy):
            b = self.shared.budget
            log.warning("refusing a request body: %d bytes of bodies held, the bound is %d",
                        b.held, b.limit)
        cycle = self.cycle
        cycle.close()
        cycle.linger = True
        if cycle.framing:
            return  # the answer has begun: the close tells the client
        self.tx.started, cycle.sent_end, cycle.framing = True, True, NO_BODY
        await self._refuse_raw(e.status, e.code, e.message, path, e.retry_after)

    async def _linger(self) -> None:
        """Close gently: our side first, then drop what the client still sends (bounded),
        so the last answer reaches it rather than a reset."""
        if not self.transport.shutdown_write():  # the connection is gone (a reset)
            self.cycle.peer_closed()
            return
        dropped = 0
        with trio.move_on_after(LINGER_SECONDS):
            while dropped < LINGER_BYTES:
                data = await self.rx._wait(float("inf"))
                if not data:
                    return
                dropped += len(data)


def _path_of(raw: bytes) -> str:
    """The request target in a raw head (for the error's API shape), "/" when there is none."""
    parts = raw.split(b" ", 2)
    return parts[1].decode("latin-1") if len(parts) >= 2 else "/"
