"""Response heads for the lean HTTP/1.1 server (appliance/server/connection.py): plain functions.

Theory of operation: the server holds a response's head until its first body message,
then `response_head` decides the framing and writes the head's bytes at once:

- HEAD, 1xx, 204, 304: no body (NO_BODY); a HEAD keeps the app's content-length (or the
  length of the one body message it gave, what a GET would say).
- The app's own content-length: SIZED (a body longer than it said is cut, and the
  connection closed -- so is one shorter).
- One body message and no content-length: SIZED by that message.
- A streamed body (`more_body`): CHUNKED on HTTP/1.1, UNTIL_CLOSE (delimited by the close)
  on HTTP/1.0.
- `connection: close` when the client asked for it, the app did, HTTP/1.0 without a
  length, or the server is about to close (drain, the requests bound).

Header names are written in lower case (as hypercorn does); a name or value with CR, LF
(or a colon in a name) is refused (RuntimeError: an app bug, never sent). Every head
carries `date` (made once a second), no `server`.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus
from typing import NamedTuple

from appliance.h1.state import CHUNKED, NO_BODY, SIZED, UNTIL_CLOSE

NO_BODY_STATUS = frozenset({204, 304})


def status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1")


_STATUS = {s.value: status_line(s.value) for s in HTTPStatus}
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


def first_line(status: int) -> bytes:
    return _STATUS.get(status) or status_line(status)


class Framed(NamedTuple):
    head: bytes
    framing: str  # SIZED, CHUNKED, UNTIL_CLOSE, NO_BODY (appliance/h1/state.py)
    length: int  # SIZED: the body's length
    close: bool  # the connection ends after this response


def response_head(status: int, headers: list[tuple[bytes, bytes]], *, method: str,
                  version: str, close: bool, body: bytes, more: bool) -> Framed:
    """The head of a response whose first body message is `body` (`more`: more follow)."""
    lines = [first_line(status), date_header()]
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
