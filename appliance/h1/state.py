"""One HTTP/1.1 connection's request/response cycle, as a table (after h11's `_state.py`).

Owns whether a connection lives on, and nothing else decides it: the server's code
(appliance/server/connection.py) tells the table what happened (`client(event)`,
`server(event)`, `close()`) and asks what may come next (`reusable`). No sockets, no trio.
- The client (our peer): IDLE -> SEND_BODY on its head (DONE at once without a body) ->
  DONE at the body's end; its close before DONE is an ERROR, after it CLOSED.
- The server (us): IDLE -> SEND_RESPONSE once a request came -> SEND_BODY when the
  response's head is decided -> DONE at its end; a failed write, or a response with more
  or fewer bytes than it said, is an ERROR.
- Keep-alive off (either side said `close`, HTTP/1.0, a drain, `max_requests`): a DONE
  side is MUST_CLOSE. The next cycle needs both sides DONE (`reusable`); an answer that
  ended while the request's body is still owed leaves the client in SEND_BODY (the server
  skips a body already here whole, else closes). ERROR and CLOSED never change again.
Beside the states, the cycle's facts the sides act on, so a test reads the whole state
here: the response's framing (`respond`: SIZED with the bytes it owes, CHUNKED,
UNTIL_CLOSE, NO_BODY -- the words appliance/h1/parse.py uses for a response received),
`sent_end`, `end_given` (the app has the body's last message), `eof`, `linger` (a
refusal's close drains the read side first). The response's head and framing are decided
here too (`response_head`).
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, NamedTuple

from appliance.h1.errors import LocalProtocolError

# States.
IDLE: Final = "IDLE"
SEND_RESPONSE: Final = "SEND_RESPONSE"
SEND_BODY: Final = "SEND_BODY"
DONE: Final = "DONE"
MUST_CLOSE: Final = "MUST_CLOSE"
CLOSED: Final = "CLOSED"
ERROR: Final = "ERROR"

# How a response's body is framed (sent by us, or received from a peer we dialled).
SIZED: Final = "sized"  # Content-Length
CHUNKED: Final = "chunked"
UNTIL_CLOSE: Final = "close"  # the connection's end ends it (HTTP/1.0, or no length)
NO_BODY: Final = "none"  # HEAD, 1xx, 204, 304 (or a refusal written whole)

# Events.
REQUEST: Final = "REQUEST"  # the client's head was read (it has a body to send)
REQUEST_NO_BODY: Final = "REQUEST_NO_BODY"  # ... a head with no body
BODY_END: Final = "BODY_END"  # the last byte of the request's body was read
RESPONSE: Final = "RESPONSE"  # the response's head (and framing) decided
RESPONSE_END: Final = "RESPONSE_END"  # the last byte of the response was written
PEER_CLOSED: Final = "PEER_CLOSED"  # the client's end of the stream (or a reset)
BROKEN: Final = "BROKEN"  # a framing error, or a write that failed

_CLIENT: dict[str, dict[str, str]] = {
    IDLE: {REQUEST: SEND_BODY, REQUEST_NO_BODY: DONE, PEER_CLOSED: CLOSED, BROKEN: ERROR},
    SEND_BODY: {BODY_END: DONE, PEER_CLOSED: ERROR, BROKEN: ERROR},
    DONE: {PEER_CLOSED: CLOSED, BROKEN: ERROR},
    MUST_CLOSE: {PEER_CLOSED: CLOSED, BROKEN: ERROR},
    CLOSED: {},
    ERROR: {},
}
_SERVER: dict[str, dict[str, str]] = {
    IDLE: {BROKEN: ERROR},  # (SEND_RESPONSE follows the client's head: see _settle)
    SEND_RESPONSE: {RESPONSE: SEND_BODY, BROKEN: ERROR},
    SEND_BODY: {RESPONSE_END: DONE, BROKEN: ERROR},
    DONE: {BROKEN: ERROR},
    MUST_CLOSE: {BROKEN: ERROR},
    CLOSED: {},
    ERROR: {},
}


class Cycle:
    """The two sides' states on one connection (see the module's docstring)."""

    __slots__ = ("their", "ours", "keep_alive", "framing", "owed", "sent_end", "end_given",
                 "eof", "linger")

    def __init__(self) -> None:
        self.their = IDLE
        self.ours = IDLE
        self.keep_alive = True
        self.eof = False  # the client's end of the stream came (or the connection broke)
        self.linger = False  # a refusal: the read side is drained a moment before the close
        self.framing = ""  # the response's: "" until its head is decided, then SIZED...
        self.owed = 0  # SIZED: the bytes it still owes
        self.sent_end = False  # the response's last message was taken (written or dropped)
        self.end_given = False  # the app was given the request body's last message

    def respond(self, framing: str, owed: int, close: bool) -> None:
        """The response's head is decided: its framing, and whether it ends the connection."""
        self.framing, self.owed = framing, owed
        if close:
            self.close()
        if self.ours == SEND_RESPONSE:
            self.server(RESPONSE)

    def peer_closed(self) -> None:
        """The client's end of the stream (a FIN, a reset, a TLS error). Mid-body it is the
        body reader's to call a BROKEN body."""
        if not self.eof:
            self.eof = True
            if self.their in (IDLE, DONE, MUST_CLOSE):
                self.client(PEER_CLOSED)

    def client(self, event: str) -> None:
        try:
            their = self.their = _CLIENT[self.their][event]
        except KeyError:
            raise LocalProtocolError(f"client: {event} is not allowed in {self.their}") from None
        # What the client's move settles (the server's own moves cannot touch these).
        if self.ours == IDLE and their in (SEND_BODY, DONE):
            self.ours = SEND_RESPONSE
        if their == DONE and not self.keep_alive:
            self.their = MUST_CLOSE

    def server(self, event: str) -> None:
        try:
            ours = self.ours = _SERVER[self.ours][event]
        except KeyError:
            raise LocalProtocolError(f"server: {event} is not allowed in {self.ours}") from None
        if ours == DONE and not self.keep_alive:
            self.ours = MUST_CLOSE

    def close(self) -> None:
        """No next cycle: either side said close, or the server drains."""
        self.keep_alive = False
        if self.their == DONE:
            self.their = MUST_CLOSE
        if self.ours == DONE:
            self.ours = MUST_CLOSE

    @property
    def reusable(self) -> bool:
        """Both sides finished cleanly and keep-alive holds: the next request may come."""
        return self.their == DONE and self.ours == DONE

    @property
    def body_owed(self) -> bool:
        return self.their == SEND_BODY

    @property
    def answered(self) -> bool:
        return self.ours in (DONE, MUST_CLOSE)

    def next_cycle(self) -> None:
        if not (self.their == DONE and self.ours == DONE):
            raise LocalProtocolError(f"no next cycle from {self.their}/{self.ours}")
        self.their = self.ours = IDLE
        self.framing, self.owed, self.sent_end, self.end_given = "", 0, False, False


# --- the response's head and framing -----------------------------------------------------

NO_BODY_STATUS = frozenset({204, 304})


def status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1")


STATUS_LINES = {s.value: status_line(s.value) for s in HTTPStatus}
_date_second = 0
_date_line = b""


def date_header() -> bytes:
    """The `date` header line, made once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_line = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_line


class Framed(NamedTuple):
    head: bytes
    framing: str  # SIZED, CHUNKED, UNTIL_CLOSE, NO_BODY (above)
    length: int  # SIZED: the body's length
    close: bool  # the connection ends after this response


def response_head(status: int, headers: list[tuple[bytes, bytes]], *, method: str,
                  version: str, close: bool, body: bytes, more: bool) -> Framed:
    """The head of a response whose first body message is `body` (`more`: more follow).

    HEAD, 1xx, 204, 304 carry no body (a HEAD keeps the content-length a GET would say);
    the app's content-length, or one body message, is SIZED (more or fewer bytes than said:
    cut and closed); a streamed body is CHUNKED on HTTP/1.1, UNTIL_CLOSE on 1.0;
    `connection: close` when either side or HTTP/1.0 asks, or the server is about to close.
    Names go out in lower case; CR, LF (or a colon in a name) is an app bug (RuntimeError).
    Every head carries `date` (made once a second), no `server`."""
    lines = [STATUS_LINES.get(status) or status_line(status), date_header()]
    sized = -1
    for k, v in headers:
        k = k.lower()
        if b"\n" in v or b"\r" in v or b"\n" in k or b"\r" in k or b":" in k:
            raise RuntimeError(f"invalid response header {k!r}")
        if k == b"content-length":
            sized = int(v)
        elif k == b"connection":
            close = close or b"close" in v.lower()
        elif k != b"transfer-encoding":  # the framing is ours to choose
            lines.append(k + b": " + v + b"\r\n")
    length = 0
    if method == "HEAD" or status in NO_BODY_STATUS or status < 200:
        framing = NO_BODY
        if sized >= 0:
            lines.append(b"content-length: %d\r\n" % sized)
        elif not more and body and status >= 200 and status not in NO_BODY_STATUS:
            lines.append(b"content-length: %d\r\n" % len(body))
    elif sized >= 0 or not more:
        framing, length = SIZED, sized if sized >= 0 else len(body)
        lines.append(b"content-length: %d\r\n" % length)
    elif version == "1.1":
        framing = CHUNKED
        lines.append(b"transfer-encoding: chunked\r\n")
    else:
        framing, close = UNTIL_CLOSE, True
    if close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return Framed(b"".join(lines), framing, length, close)
