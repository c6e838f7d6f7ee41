"""The one body reader of HTTP/1.1 messages, sized, chunked or close-delimited: strict, bounded.

Owns the framing of every body this project reads (a client every response body, the
server every request body): `ChunkedBody`, `SizedBody` (Content-Length), `CloseBody` (up to
the connection's end, `end()`), with one interface -- `feed(data)` returns the payload in
`data`, plus `done`, `leftover` (bytes after the body's end: a peer that said more than it
framed) and `error`. Sync, no I/O, no time; a relayed stream passes through unchanged, so
only payload bytes come out, not h11's events (~8% of a hop's budget per event:
docs/streams-profile.md). A chunk's data is never buffered: what a read brought is returned.

Strict on purpose -- every byte a peer sends is untrusted, and each of these is `BodyError`:
- a size line other than 1-16 hex digits, then `;` and extensions of visible bytes
  (ignored; no white space before the `;`: h11 refuses it), then CRLF -- a sign, `0x`, a
  bare LF, no digits;
- a size or trailer line over MAX_LINE without its CRLF, trailers over MAX_TRAILERS;
- anything but CRLF after a chunk's data; a trailer line that is not a header field
  (trailers are dropped: the relay does not forward them);
- a request body whose chunks, past FREE_CHUNKS, average under `min_average` payload bytes
  (the server's CPU bound per payload byte: below).
"""

from __future__ import annotations

import re

from appliance.h1.errors import RemoteProtocolError
from appliance.h1.parse import TOKEN, VALUE

# A size line (hex digits, extensions) or one trailer line: h11 allows 64 KiB for a whole
# head; a chunk's size line is a handful of bytes from any real server.
MAX_LINE = 4096
# All trailer lines of one body together.
MAX_TRAILERS = 16384
# More hex digits than this is a size no peer sends (16 digits: up to 2**64 - 1).
MAX_SIZE_DIGITS = 16

_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIZE_DIGITS = re.compile(rb"[0-9A-Fa-f]{1,%d}" % MAX_SIZE_DIGITS)
# Extensions: `;` right after the digits (h11 refuses white space before it; so do we).
_CHUNK_EXT = re.compile(rb"(?:;[\t\x20-\x7e\x80-\xff]*)?")
# A request body's framing costs CPU per chunk, not per byte (~1.5-3.5 us a chunk on a busy
# 2-core box: 1 MB in 1-byte chunks took 3.6 s, in 512-byte chunks 3 ms), so the server
# bounds it per payload byte: ordinary streamed uploads (curl, httpx, fetch: 512 bytes to
# 64 KiB a chunk) pass, tiny chunks cost at most ~16 ns of framing per byte. A relayed
# stream from a peer we dialled (a chunk per token) has no such bound.
# Chunks a body may have before `min_average` applies.
FREE_CHUNKS = 1024
# What one chunk costs the reader beyond its payload, about (see the docstring), and the
# framing CPU a request body may cost per payload byte past its FREE_CHUNKS.
CHUNK_COST_NS = 2000
MAX_NS_PER_BYTE = 16
# The server's bound on a request body's average chunk (appliance/server/receive.py).
MIN_AVERAGE_CHUNK = CHUNK_COST_NS // MAX_NS_PER_BYTE  # 125 bytes
_SIZE, _DATA, _CRLF, _TRAILER, _DONE = range(5)


class BodyError(RemoteProtocolError):
    """The peer's body framing is broken; the message says how (for an operator)."""


class ChunkedBody:
    """Incremental, strict reader of a `Transfer-Encoding: chunked` body."""

    __slots__ = ("_state", "_owed", "_buf", "_trailers", "leftover", "error", "_chunks",
                 "_payload", "_min_average", "done")

    def __init__(self, min_average: int = 0) -> None:
        self._min_average = min_average  # 0: no bound on the chunks' count
        self._chunks = 0
        self._payload = 0
        self._state = _SIZE
        self._owed = 0  # payload bytes the current chunk still owes
        self._buf = b""  # an incomplete size line, CRLF or trailer line
        self._trailers = 0
        self.leftover = b""
        # Broken framing after some payload in the same read: that payload is returned
        # first, the error is raised by the next `feed` (call it at once, with b"").
        self.error: BodyError | None = None
        self.done = False  # the last chunk and the trailers' end were read

    def feed(self, data: bytes) -> bytes:
        """The payload in `data` (b"" when it held none); raises BodyError -- at once, or,
        when `data` held payload before the break, from the next call (see `error`)."""
        if self.error is not None:
            raise self.error
        if self.done:
            self.leftover += data
            return b""
        if self._buf:
            data = self._buf + data
            self._buf = b""
        # The common case, one whole frame per read: "<hex>\r\n<payload>\r\n".
        if self._state == _SIZE:
            i = data.find(b"\r\n")
            if 0 < i <= MAX_SIZE_DIGITS:
                head = data[:i]
                if _HEX.issuperset(head):
                    n = int(head, 16)
                    end = i + 2 + n
                    if n and len(data) == end + 2 and data[end:] == b"\r\n":
                        if self._min_average:  # (a request body's bound: a reply has none)
                            self._count(n)
                        return data[i + 2:end]
        out: list[bytes] = []
        try:
            self._frames(data, out)
        except BodyError as e:
            if not out:
                raise
            self.error = e
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)

    def _frames(self, data: bytes, out: list[bytes]) -> None:
        pos = 0
        size = len(data)
        while pos < size:
            state = self._state
            if state == _DATA:
                take = min(self._owed, size - pos)
                out.append(data[pos:pos + take])
                pos += take
                self._owed -= take
                if not self._owed:
                    self._state = _CRLF
            elif state == _CRLF:
                if size - pos < 2:
                    if data[pos:] != b"\r":
                        raise BodyError("a chunk's data is not followed by CRLF")
                    self._buf = data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    raise BodyError("a chunk's data is not followed by CRLF")
                pos += 2
                self._state = _SIZE
            elif state == _SIZE:
                i = self._line_end(data, pos, "a chunk size line")
                if i < 0:
                    break
                line = data[pos:i]
                # Plain hex digits (every relayed chunk) without the regexes.
                n = (int(line, 16) if 0 < i - pos <= MAX_SIZE_DIGITS and _HEX.issuperset(line)
                     else _chunk_size(line))
                pos = i + 2
                if n:
                    if self._min_average:
                        self._count(n)
                    end = pos + n
                    if data[end:end + 2] == b"\r\n":  # the whole chunk is in this read
                        out.append(data[pos:end])
                        pos = end + 2
                        continue
                    self._owed = n
                    self._state = _DATA
                else:
                    self._state = _TRAILER
            elif state == _TRAILER:
                i = self._line_end(data, pos, "a trailer line")
                if i < 0:
                    break
                line = data[pos:i]
                pos = i + 2
                if not line:
                    self._state = _DONE
                    self.done = True
                    self.leftover = data[pos:]
                    break
                name, colon, value = line.partition(b":")
                if not colon or TOKEN.fullmatch(name) is None or VALUE.fullmatch(value) is None:
                    raise BodyError("a trailer line is not a header field")
                self._trailers += len(line) + 2
                if self._trailers > MAX_TRAILERS:
                    raise BodyError(f"trailers are over {MAX_TRAILERS} bytes")

    def _count(self, n: int) -> None:
        """One more chunk of `n` bytes against the bound on their average size."""
        self._chunks += 1
        self._payload += n
        if self._chunks > FREE_CHUNKS and self._payload < self._chunks * self._min_average:
            raise BodyError(f"more than {FREE_CHUNKS} chunks averaging under "
                            f"{self._min_average} bytes")

    def _line_end(self, data: bytes, pos: int, what: str) -> int:
        """Where the line at `pos` ends (its CR), or -1 with the partial line kept for the
        next read; BodyError when it is too long or not ended by CRLF."""
        i = data.find(b"\r\n", pos, pos + MAX_LINE + 2)
        if i < 0:
            rest = data[pos:]
            if len(rest) > MAX_LINE or b"\n" in rest.rstrip(b"\r"):
                raise BodyError(f"{what} is over {MAX_LINE} bytes or not ended by CRLF")
            self._buf = rest
        return i


def _chunk_size(line: bytes) -> int:
    """The size in a chunk's size line (without its CRLF); BodyError when it is not one."""
    m = _SIZE_DIGITS.match(line)
    if m is None or _CHUNK_EXT.fullmatch(line, m.end()) is None:
        raise BodyError(f"bad chunk size line {line[:40]!r}")
    return int(m.group(), 16)


class SizedBody:
    """A `Content-Length` body: payload until `length` bytes were read."""

    __slots__ = ("_owed", "leftover", "error", "done")

    def __init__(self, length: int) -> None:
        self._owed = length
        self.leftover = b""
        self.error: BodyError | None = None  # never set: a count cannot be broken
        self.done = length == 0  # all `length` bytes were read

    @property
    def remaining(self) -> int:
        """Payload bytes still to come."""
        return self._owed

    def feed(self, data: bytes) -> bytes:
        if len(data) <= self._owed:
            self._owed -= len(data)
            self.done = self._owed == 0
            return data
        out, self.leftover = data[:self._owed], self.leftover + data[self._owed:]
        self._owed = 0
        self.done = True
        return out


class CloseBody:
    """A response body with no length and no chunking: everything until the connection's
    end (`end()`, called at EOF). Never reusable: the connection ends with it."""

    __slots__ = ("leftover", "error", "done")

    def __init__(self) -> None:
        self.leftover = b""
        self.error: BodyError | None = None  # never set: an end cannot be broken
        self.done = False  # the connection's end came (`end`)

    def feed(self, data: bytes) -> bytes:
        return data

    def end(self) -> None:
        self.done = True


Body = ChunkedBody | SizedBody | CloseBody


def ends_at_close(body: Body) -> bool:
    """Whether the end of the stream is this body's end (else it is cut short)."""
    if isinstance(body, CloseBody):
        body.end()
        return True
    return False
