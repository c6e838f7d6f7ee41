"""Strict HTTP/1.1 heads, both ways: plain functions over bytes, no I/O, no state.

Owns the reading and writing of heads: `parse_head` (the server: a request head in),
`encode_request` and `parse_response_head` (appliance/client/upstream.py: a request head
out, the answer's head in). A head is what precedes the first CRLF CRLF. Each accepts
less than h11, never more (tests/h1/test_h1parse.py and test_h1client.py check it).
- Request heads (`Head`, or `BadRequest` with the status to answer; the server then
  closes): a request line of exactly `TOKEN SP TARGET SP HTTP/1.x` (visible ASCII, at most
  MAX_TARGET bytes, else 414; x above 1 served as 1.1, other majors 505; an absolute-form
  target read as its path); CRLF only; token names, visible values, no obs-fold; at most
  `max_headers` fields (431); one Content-Length of digits; Transfer-Encoding `chunked`
  only (501), not on HTTP/1.0, never with Content-Length (400, RFC 9112 6.1); one Host
  (HTTP/1.1: exactly one), one Authorization, one X-Api-Key (a proxy in front may read
  the other one than we do).
- Response heads (`ResponseHead`, None while incomplete up to MAX_HEAD, or
  `BrokenResponse`): `HTTP/1.x DDD ...`; one Content-Length value (equal repeats allowed),
  `chunked` only and before Content-Length (RFC 9112 6.3); framing SIZED (0 for HEAD,
  1xx, 204, 304), CHUNKED or UNTIL_CLOSE; HTTP/1.0 and `connection: close` not kept alive.
- A request head out refuses CR, LF or NUL in a value (ValueError).
"""

from __future__ import annotations

import re
from operator import itemgetter
from typing import NamedTuple

from appliance.h1.errors import RemoteProtocolError
from appliance.h1.state import CHUNKED, SIZED, UNTIL_CLOSE

MAX_HEADERS = 128
# A request target longer than this is refused 414: nginx's default buffer for a request
# line (large_client_header_buffers, 8 KiB); no route here is longer than a few dozen bytes.
MAX_TARGET = 8192

TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_REQUEST_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+) ([\x21-\x7e]+) HTTP/([0-9])\.([0-9])")
VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
DIGITS = re.compile(rb"[0-9]{1,18}")


class BadRequest(RemoteProtocolError):
    """A request this server will not read further: answer `status`, then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, status)
        self.status = status


class Head(NamedTuple):
    """A request head, as `parse_head` read it."""

    method: str
    target: bytes
    version: str  # "1.0" or "1.1"
    headers: list[tuple[bytes, bytes]]  # (lower-case name, value) as received
    length: int  # Content-Length, else 0 (chunked: see `chunked`)
    chunked: bool
    keep_alive: bool
    expect_continue: bool


def parse_head(head: bytes, max_headers: int = MAX_HEADERS) -> Head:
    """The request in `head` (its bytes before the blank line, without it)."""
    lines = head.split(b"\r\n")
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise BadRequest(400, "malformed request line")
    method, target, major, minor = m.groups()
    if major != b"1":
        raise BadRequest(505, "HTTP version not supported")
    version = "1.0" if minor == b"0" else "1.1"
    if len(target) > MAX_TARGET:
        raise BadRequest(414, "request target too long")
    if target[:1] != b"/":
        target = _origin_form(target)
    if len(lines) - 1 > max_headers:
        raise BadRequest(431, f"more than {max_headers} header fields")
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    chunked = False
    te = False
    hosts = 0
    auth = xkey = False  # an Authorization, an X-Api-Key field seen (one each at most)
    keep_alive = version == "1.1"
    expect = False
    token = TOKEN.fullmatch
    valid = VALUE.fullmatch
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or token(name) is None:
            raise BadRequest(400, "malformed header field (obs-fold is not accepted)")
        value = value.strip(b" \t")
        if valid(value) is None:
            raise BadRequest(400, "invalid bytes in a header value")
        name = name.lower()
        headers.append((name, value))
        if name == b"content-length":
            if length >= 0 or DIGITS.fullmatch(value) is None:
                raise BadRequest(400, "invalid or repeated Content-Length")
            length = int(value)
        elif name == b"transfer-encoding":
            if te:
                raise BadRequest(400, "repeated Transfer-Encoding")
            te = True
            if value.lower() != b"chunked":
                raise BadRequest(501, "only Transfer-Encoding: chunked is supported")
            chunked = True
        elif name == b"host":
            hosts += 1
        elif name == b"authorization":
            if auth:
                raise BadRequest(400, "repeated Authorization header")
            auth = True
        elif name == b"x-api-key":
            if xkey:
                raise BadRequest(400, "repeated X-Api-Key header")
            xkey = True
        elif name == b"connection":
            low = value.lower()  # (most say keep-alive: no "close" in it, nothing to split)
            if b"close" in low and b"close" in {t.strip() for t in low.split(b",")}:
                keep_alive = False
        elif name == b"expect":
            expect = value.lower() == b"100-continue"
    if te and length >= 0:
        raise BadRequest(400, "ambiguous request framing: both Transfer-Encoding and "
                              "Content-Length (RFC 9112 section 6.1)")
    if te and version == "1.0":
        raise BadRequest(400, "Transfer-Encoding on an HTTP/1.0 request")
    if hosts > 1 or (version == "1.1" and hosts == 0):
        raise BadRequest(400, "a request has one Host header (HTTP/1.1: exactly one)")
    return Head(method.decode("ascii"), target, version, headers, max(length, 0), chunked,
                keep_alive, expect and version == "1.1")


_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]+")


def _origin_form(target: bytes) -> bytes:
    """The path and query of an absolute-form target (`http://host/p?q` -> `/p?q`); any
    other target that does not start with "/" is refused (`*` means nothing to our routes)."""
    m = _ABSOLUTE.match(target)
    if m is None:
        raise BadRequest(400, "malformed request target")
    rest = target[m.end():]
    return rest if rest[:1] == b"/" else b"/" + rest


# --- the client's side: a request head out, a response head in ----------------------------

# h11's own bound on an incomplete head, as the upstream used it.
MAX_HEAD = 64 * 1024
MAX_RESPONSE_HEADERS = 256

# The reason phrase: tabs, spaces, visible bytes, obs-text (RFC 9112 4; h11 refuses the rest).
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: [\t\x20-\x7e\x80-\xff]*)?")
_BAD_VALUE = re.compile(rb"[\x00\r\n]")
# Field lines: a token name, a colon, a value of visible bytes, spaces and tabs; no obs-fold.
_FIELDS = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e\x80-\xff]*\r\n)*")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f-\xff]")
_NAME, _VALUE = itemgetter(0), itemgetter(1)


class BrokenResponse(RemoteProtocolError):
    """The peer's response head cannot be read (the message says why, for an operator)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 502)


class ResponseHead(NamedTuple):
    """A response head, as `parse_response_head` read it."""

    status_code: int
    raw_headers: list[tuple[bytes, bytes]]  # (lower-case name, value) as received
    headers: dict[str, str]  # name -> value (latin-1 text), the first of repeated names
    framing: str  # SIZED, CHUNKED, UNTIL_CLOSE (appliance/h1/state.py)
    length: int  # the body's bytes when framing is SIZED
    keep_alive: bool


def encode_request(method: str, target: str, headers: list[tuple[bytes, bytes]],
                   body_length: int) -> bytes:
    """`METHOD target HTTP/1.1`, the headers, `content-length`, the blank line."""
    if _BAD_TARGET.search(target) or not TOKEN.fullmatch(method.encode("latin-1")):
        raise ValueError(f"bad request line {method!r} {target[:80]!r}")
    if (not TOKEN.fullmatch(b"".join(map(_NAME, headers)) or b"x")
            or _BAD_VALUE.search(b"".join(map(_VALUE, headers)))):
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
    text: dict[str, str] = {}
    length = -1
    te: bytes | None = None
    close = minor == b"0"
    if first < end:
        # Every field line at once (one C call); a bad one is named below.
        if not _FIELDS.fullmatch(buf, first + 2, end + 2):
            _bad_field(buf[first + 2:end])
        lines = buf[first + 2:end].split(b"\r\n")
        if len(lines) > MAX_RESPONSE_HEADERS:
            raise BrokenResponse(f"more than {MAX_RESPONSE_HEADERS} header fields")
        for line in lines:
            name, _, value = line.partition(b":")
            name = name.lower()
            value = value.strip(b" \t")
            headers.append((name, value))
            text.setdefault(name.decode("latin-1"), value.decode("latin-1"))
            if name == b"content-length":
                for one in value.split(b","):
                    one = one.strip(b" \t")
                    if not DIGITS.fullmatch(one) or (length >= 0 and int(one) != length):
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
    return ResponseHead(status, headers, text, framing, length, keep_alive), end + 4


def _bad_field(block: bytes) -> None:
    for line in block.split(b"\r\n"):
        if not _FIELDS.fullmatch(line + b"\r\n"):
            raise BrokenResponse(f"malformed header line {line[:80]!r}")
    raise BrokenResponse("malformed header block")
