"""Line-framed JSON (NDJSON, JSON lines, SSE `data:` lines): written escaped, read on `\\n`.

Theory of operation: a line ends at the byte `\\n` and nowhere else. msgspec (like most
JSON encoders) escapes the control characters but writes U+0085, U+2028 and U+2029 raw,
and readers that split on Unicode line breaks (Python's `str.splitlines`, httpx's
`aiter_lines`) cut a line there: one model name holding U+2028 made every node's watch
line undecodable and took the fleet down. So every line this project writes goes through
`escape_breaks` (those three become `\\u0085`, `\\u2028`, `\\u2029`: the same JSON value),
and every line it reads is split by `LineReader` on the byte `\\n` with a bound on its
length. In UTF-8 those characters are the only sequences with their bytes (UTF-8 is
self-synchronising) and JSON's own syntax is ASCII, so the bytes can only be inside a
string: replacing them never changes what a decoder reads.

It never decodes JSON and never does I/O (`aiter_lines` only iterates what it is given).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import msgspec

# The Unicode line breaks that a JSON encoder leaves raw, as UTF-8, and their escapes
# (the others -- \n \r \v \f \x1c \x1d \x1e -- are control characters, escaped by JSON).
RAW_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"),
              (b"\xe2\x80\xa9", b"\\u2029"))


def escape_breaks(data: bytes) -> bytes:
    """JSON text with U+0085, U+2028, U+2029 written as escapes (the same value)."""
    for raw, escaped in RAW_BREAKS:
        data = data.replace(raw, escaped)
    return data


class LineEncoder:
    """A msgspec JSON encoder whose output is safe to frame by lines."""

    def __init__(self) -> None:
        self._enc = msgspec.json.Encoder()

    def encode(self, obj: Any) -> bytes:
        data = self._enc.encode(obj)
        if b"\xc2\x85" in data or b"\xe2\x80" in data:  # a break to escape (rare): the slow way
            return escape_breaks(data)
        return data

    def line(self, obj: Any) -> bytes:
        """One NDJSON line: the encoded object and its `\\n`."""
        return self.encode(obj) + b"\n"


class LineTooLong(ValueError):
    """A line ran past its reader's bound without a `\\n`."""


class LineReader:
    """Bytes in, complete lines out (without their `\\n`; a `\\r` before it is kept).
    A line longer than `max_line` bytes raises LineTooLong: the peer is broken or hostile,
    and holding it whole is what the bound is for."""

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        if b"\n" not in data:
            if len(self._buf) > self.max_line:
                raise LineTooLong(f"line over {self.max_line} bytes")
            return []
        lines = self._buf.split(b"\n")
        rest = lines.pop()
        self._buf = bytearray(rest)
        if len(rest) > self.max_line or any(len(x) > self.max_line for x in lines):
            raise LineTooLong(f"line over {self.max_line} bytes")
        return [bytes(x) for x in lines]

    def tail(self) -> bytes:
        """What was fed after the last `\\n` (an unterminated last line)."""
        return bytes(self._buf)


async def aiter_lines(chunks: AsyncIterator[bytes], max_line: int) -> AsyncIterator[bytes]:
    """The lines of a byte stream, split on `\\n` only; an unterminated last line too."""
    reader = LineReader(max_line)
    async for chunk in chunks:
        for line in reader.feed(chunk):
            yield line
    if last := reader.tail():
        yield last


def iter_lines(chunks: Iterable[bytes], max_line: int) -> Iterator[bytes]:
    """`aiter_lines` for a blocking byte stream (the ctl's)."""
    reader = LineReader(max_line)
    for chunk in chunks:
        yield from reader.feed(chunk)
    if last := reader.tail():
        yield last
