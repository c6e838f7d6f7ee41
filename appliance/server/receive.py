"""The receive side of one HTTP/1.1 connection (appliance/server/connection.py): the
request's body to the app's `receive`, and the wait for its client to go.

Owns the reading after the head: the connection composes a `Receiver` with the send side
(send.py, `Sender`) over one table and calls `new_request` with each head. Bodies are
framed by appliance/h1/body.py (chunked) or counted down here (Content-Length); the
client's side of the table (appliance/h1/state.py) moves as they end, break or are
skipped. Nothing here writes but the `100 Continue`; a refusal is raised (`Busy`,
`RequestTimeout`) or noted (`bad`) and the connection answers it.
- A body is read only when the app asks, each read bounded by `body_deadline` (408); the
  bytes the apps hold count against the listener's `Budget` (503 `busy`), decoded
  estimates too (`hold`: the ASGI extension BODY_BUDGET). `Expect: 100-continue` is
  answered on the first body read, unless the answer began or body bytes are here.
- Broken framing, or a client gone before the body's end, is a 400 (`bad`): the app is
  told `http.disconnect`, the connection refuses and closes.
- Once the body is read, `receive` waits for the client to go or the answer to end and
  says `http.disconnect` (pipelined bytes read meanwhile are kept, up to a bound).
- A body the app did not read but that is here whole is skipped (`_skip_unread_body`).
"""

from __future__ import annotations

import copy
from typing import Any

import trio

from appliance.h1.body import MIN_AVERAGE_CHUNK, BodyError, ChunkedBody
from appliance.h1.parse import BadRequest, Head
from appliance.h1.state import BODY_END, BROKEN, ERROR, SEND_BODY
from appliance.net.transport import Transport
from appliance.server.limits import Busy, ListenerRefusal, RequestTimeout
from appliance.server.send import Sender

MAX_RECV = 65536
# Pipelined bytes held while a response is written; past this the connection stops reading.
MAX_PIPELINED = 64 * 1024
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Budget:
    """Body bytes held at once by one listener's requests (503 `busy` past `limit`)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


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


class Receiver:
    """One connection's request side (see the module's docstring); `new_request` with
    each head. It reads what its send side `tx` (appliance/server/send.py) did -- whether
    the answer began, ended or broke -- and shares its table (`cycle`)."""

    def __init__(self, transport: Transport, budget: Budget, tx: Sender) -> None:
        self.transport = transport
        self.tx = tx
        self.cycle = tx.cycle
        self.budget = budget
        self.buf = b""
        self.body_deadline = float("inf")  # the connection sets it per request
        self.body_seconds = 0.0  # ... from this many seconds (its 408 says so)
        self._waiter: trio.CancelScope | None = None  # receive() waiting for the disconnect
        self.new_request(None)

    def new_request(self, head: Head | None) -> None:
        self.head = head
        self.body_left = head.length if head is not None else 0
        self.chunks = (ChunkedBody(MIN_AVERAGE_CHUNK) if head is not None and head.chunked
                       else None)
        self.bad: BadRequest | None = None
        self.held = 0
        self.reads = 0
        self.continued = False

    async def _wait(self, deadline: float) -> bytes | None:
        """The next bytes (b"" at the end), or None past `deadline`."""
        with trio.CancelScope(deadline=deadline):
            data = await self.transport.receive(MAX_RECV)
            if not data:
                self.cycle.peer_closed()
            return data
        return None

    # --- the app's receive ---------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        if self.bad is not None or self.cycle.ours == ERROR:
            return _disconnect()
        if self.cycle.their == SEND_BODY:
            return await self._body()
        if not self.cycle.end_given:
            self.cycle.end_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await self._wait_disconnect()

    async def _body(self) -> dict[str, Any]:
        if self.head is not None and self.head.expect_continue and not self.continued:
            self.continued = True
            if not self.tx.started and not self.buf:
                await self.tx.write(_CONTINUE)
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
        self.cycle.linger = True
        if self.cycle.their == SEND_BODY:
            self.cycle.client(BROKEN)
        return _disconnect()

    async def _read_body(self) -> bytes:
        self.reads += 1
        if self.reads == 1:  # the body most often followed its head: no wait for it
            data = self.transport.receive_nowait(MAX_RECV)
            if data is not None:
                if not data:
                    self.cycle.peer_closed()
                return data
        data = await self._wait(self.body_deadline)
        if data is None:
            raise self._refusing(RequestTimeout(self.body_seconds))
        return data

    def _refusing(self, e: ListenerRefusal) -> ListenerRefusal:
        """A refusal leaves the rest of the body unread: the connection closes after its
        answer, whoever gives it (the listener, or an app that answers the ApiError)."""
        self.cycle.close()
        self.cycle.linger = True
        return e

    @property
    def bound(self) -> int:
        """BodyBudget (http/asgi.py): the listener's whole budget."""
        return self.budget.limit

    def hold(self, n: int) -> bool:
        """BodyBudget (http/asgi.py): `n` more bytes held for this request, given back
        with its body when it ends; False when the listener's bound would be passed."""
        if not self.budget.take(n):
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        """BodyBudget: `n` bytes the app no longer holds (written to disk) given back now."""
        n = min(n, self.held)
        self.budget.give(n)
        self.held -= n

    def _deliver(self, data: bytes) -> dict[str, Any]:
        n = len(data)
        if n:
            if not self.budget.take(n):
                raise self._refusing(Busy())
            self.held += n
        more = self.cycle.their == SEND_BODY
        if not more:
            self.cycle.end_given = True
        return {"type": "http.request", "body": data, "more_body": more}

    def body_to_come(self) -> bool:
        """The request's body is neither read nor here whole (one here whole is skipped
        after the answer: `_skip_unread_body`). Asked as an answer begins while the client
        is still in SEND_BODY: a chunked body is tried on a copy of its reader, the app may
        still read it."""
        if self.chunks is None:
            return len(self.buf) < self.body_left
        trial = copy.copy(self.chunks)
        try:
            _chunks_feed(trial, self.buf)
        except BadRequest:
            return True
        return not trial.done

    def _skip_unread_body(self) -> None:
        """Drop a body the app did not read if it is already here whole (the client is
        then DONE and the connection may serve the next request); asked while the client
        is still in SEND_BODY."""
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

    # --- the disconnect ------------------------------------------------------------------

    async def _wait_disconnect(self) -> dict[str, Any]:
        """The body is read: wait for the client to go or the response to end."""
        if self.cycle.sent_end or self.cycle.eof:
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
                        self.cycle.peer_closed()
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
