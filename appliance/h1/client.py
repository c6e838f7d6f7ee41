"""The client side of HTTP/1.1 for the proxy's upstream: a request head out, a response head in.

Theory of operation: appliance/client/upstream.py sends one request per exchange to a peer it
knows (a node, an engine) and relays the answer. h11 spent ~50 us of CPU per exchange on
that (validating every header of the request by regex, an event object and a state
machine step per event, a receive buffer) -- a tenth of a hop's share of a short request.
These are plain functions over bytes, no I/O and no state:

- `encode_request(method, target, headers, body_length)`: the head, with `content-length`
  (the body follows as it is). The names and values come from our own code, the config
  (a node's token) or a client's head that our server already parsed; still, a value
  holding CR, LF or NUL (a header split) is refused with `ValueError` rather than sent.
- `parse_response_head(buf, head_request)`: None while `buf` holds no complete head (up to
  MAX_HEAD bytes, else `BrokenResponse`), else `(ResponseHead, used)`. Strict where a
  peer's mistake would make us misread the body: a status line `HTTP/1.x DDD ...`, CRLF
  line ends, header names as tokens, no obs-fold, one Content-Length value (repeated
  equal ones allowed), Transfer-Encoding `chunked` only (as h11: anything else is broken)
  and its precedence over Content-Length (RFC 9112 6.3). The framing is one of:
  `length` bytes (0 for HEAD, 1xx, 204, 304), `chunked`, or `close` (no length given:
  the body runs to the end of the connection). HTTP/1.0 and `connection: close` are never
  kept alive (as h11). A 1xx head is returned like any other; the caller skips it.
"""

from __future__ import annotations

import re

from appliance.h1.errors import RemoteProtocolError
from appliance.h1.parse import DIGITS as _DIGITS
from appliance.h1.parse import TOKEN as _TOKEN
from appliance.h1.state import CHUNKED, SIZED, UNTIL_CLOSE

# h11's own bound on an incomplete head, as the upstream used it.
MAX_HEAD = 64 * 1024
MAX_HEADERS = 256

# The reason phrase: tabs, spaces, visible bytes, obs-text (RFC 9112 4; h11 refuses the rest).
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
# Field lines: a token name, a colon, a value of visible bytes, spaces and tabs; no obs-fold.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f-\xff]")


class BrokenResponse(RemoteProtocolError):
    """The peer's response head cannot be read (the message says why, for an operator)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 502)


class ResponseHead:
    __slots__ = ("status_code", "raw_headers", "headers", "framing", "length", "keep_alive")

    def __init__(self, status_code: int, raw_headers: list[tuple[bytes, bytes]],
                 framing: str, length: int, keep_alive: bool) -> None:
        self.status_code = status_code
        self.raw_headers = raw_headers  # (lower-case name, value) as received
        # name -> value (latin-1 text), the first of repeated names
        self.headers: dict[str, str] = {}
        for k, v in raw_headers:
            self.headers.setdefault(k.decode("latin-1"), v.decode("latin-1"))
        self.framing = framing
        self.length = length  # the body's bytes when framing is SIZED
        self.keep_alive = keep_alive


def encode_request(method: str, target: str, headers: list[tuple[bytes, bytes]],
                   body_length: int) -> bytes:
    """`METHOD target HTTP/1.1`, the headers, `content-length`, the blank line."""
    if _BAD_TARGET.search(target) or not _TOKEN.fullmatch(method.encode("latin-1")):
        raise ValueError(f"bad request line {method!r} {target[:80]!r}")
    if (not _TOKEN.fullmatch(b"".join([k for k, _ in headers]) or b"x")
            or _BAD_VALUE.search(b"".join([v for _, v in headers]))):
        raise ValueError("a request header name is not a token, or a value holds CR, LF or NUL")
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    for k, v in headers:
        parts.append(k + b": " + v + b"\r\n")
    parts.append(b"content-length: %d\r\n\r\n" % body_length)
    return b"".join(parts)


def parse_response_head(buf: bytes, head_request: bool = False
                        ) -> tuple[ResponseHead, int] | None:
    """The response head at the start of `buf` and the bytes it used; None: incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise BrokenResponse(f"response head over {MAX_HEAD} bytes")
        return None
    if end > MAX_HEAD:
        raise BrokenResponse(f"response head over {MAX_HEAD} bytes")
    first = buf.find(b"\r\n")
    m = _STATUS_LINE.fullmatch(buf, 0, first)
    if m is None:
        raise BrokenResponse(f"malformed status line {buf[:min(first, 80)]!r}")
    minor, code = m.groups()
    status = int(code)
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    te: bytes | None = None
    close = minor == b"0"
    if first < end:
        # Every field line at once (one C call); a bad one is named below.
        if not _FIELDS.fullmatch(buf, first + 2, end + 2):
            _bad_field(buf[first + 2:end])
        lines = buf[first + 2:end].split(b"\r\n")
        if len(lines) > MAX_HEADERS:
            raise BrokenResponse(f"more than {MAX_HEADERS} header fields")
        for line in lines:
            name, _, value = line.partition(b":")
            name = name.lower()
            value = value.strip(b" \t")
            headers.append((name, value))
            if name == b"content-length":
                for one in value.split(b","):
                    one = one.strip(b" \t")
                    if not _DIGITS.fullmatch(one) or (length >= 0 and int(one) != length):
                        raise BrokenResponse(f"bad content-length {value[:40]!r}")
                    length = int(one)
            elif name == b"transfer-encoding":
                if te is not None or value.lower() != b"chunked":
                    raise BrokenResponse(f"unsupported transfer-encoding {value[:40]!r}")
                te = value
            elif name == b"connection":
                if b"close" in {t.strip(b" \t").lower() for t in value.split(b",")}:
                    close = True
    if head_request or status < 200 or status in (204, 304):
        framing, length = SIZED, 0
    elif te is not None:
        framing, length = CHUNKED, 0
    elif length >= 0:
        framing = SIZED
    else:
        framing, length = UNTIL_CLOSE, 0
    keep_alive = not close and framing != UNTIL_CLOSE
    return ResponseHead(status, headers, framing, length, keep_alive), end + 4


def _bad_field(block: bytes) -> None:
    for line in block.split(b"\r\n"):
        if not _FIELDS.fullmatch(line + b"\r\n"):
            raise BrokenResponse(f"malformed header line {line[:80]!r}")
    raise BrokenResponse("malformed header block")
