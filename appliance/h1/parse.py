"""Strict HTTP/1.1 request heads: plain functions over bytes.

Theory of operation: appliance/server/connection.py reads bytes and asks this module what they
say. A head is whatever precedes the first CRLF CRLF; `parse_head` either returns it as
a `Head` (method, target, version, headers with lower-case names, the body's framing,
keep-alive, Expect: 100-continue) or raises `BadRequest` with the status to answer --
the server then closes the connection, nothing behind the head is read. It accepts
less than h11 does, never more (tests/h1/test_h1parse.py checks that against h11):

- CRLF line ends only; no blank line before the request line; a request line of exactly
  `TOKEN SP TARGET SP HTTP/1.x` (a target of visible ASCII, at most MAX_TARGET bytes,
  else 414); HTTP/1.x with x above 1 is served as HTTP/1.1 (RFC 9110 2.5: a minor
  version is backwards compatible); other versions get 505.
- The target in absolute form (`http://host/path`, RFC 9112 3.2.2: a server MUST accept
  it) is read as its path and query (origin form).
- Header names are tokens (no space before the colon); values are visible bytes, spaces
  and tabs; obs-fold (a line starting with white space) is refused.
- At most `max_headers` fields (431); the caller bounds the head's size (431, or 414
  when the request line alone is over MAX_TARGET).
- Content-Length: digits only, one field only; Transfer-Encoding: `chunked` only (501
  for anything else), one field, not on HTTP/1.0; both together: 400 (RFC 9112 6.1).
- One Host at most; HTTP/1.1 needs exactly one. One Authorization and one X-Api-Key at
  most: a proxy in front may read the other one than we do (400).

A chunked request body is read by appliance/h1/body.py's `ChunkedBody`, the reader
of relayed responses too, with the same strictness (its trailers are checked with this
module's TOKEN and VALUE).
"""

from __future__ import annotations

import re

from appliance.h1.errors import RemoteProtocolError

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


class Head:
    __slots__ = ("method", "target", "version", "headers", "length", "chunked", "keep_alive",
                 "expect_continue")

    def __init__(self, method: str, target: bytes, version: str,
                 headers: list[tuple[bytes, bytes]], length: int, chunked: bool,
                 keep_alive: bool, expect_continue: bool) -> None:
        self.method = method
        self.target = target
        self.version = version
        self.headers = headers
        self.length = length  # Content-Length, else 0 (chunked: see `chunked`)
        self.chunked = chunked
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue


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
