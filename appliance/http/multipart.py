"""A streaming `multipart/form-data` reader: sans-I/O, bounded, one pass.

Theory of operation (RFC 7578 over RFC 2046's framing): `feed(data)` returns events --
`Part(name, filename, content_type)` when a part's head is read, `bytes` for its content
as it arrives, `PartEnd()`, and `Done()` after the closing delimiter. Content is handed on
as soon as it cannot be the start of a delimiter, so a file of any size passes through
holding at most one delimiter's length back. The stream is read as if it began with CRLF,
so the first delimiter is found like every other. Part heads are bounded (HEAD_MAX) and
so is the preamble's look-back; a stream that breaks these rules raises `MultipartError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# A part's head is a few short lines (Content-Disposition, Content-Type); curl and the SDKs
# send under 300 bytes.
HEAD_MAX = 16 * 1024
# At most this many parts (OpenAI's upload takes two or three fields and the file).
MAX_PARTS = 16
_PARAM = re.compile(r';\s*([A-Za-z*]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')


class MultipartError(ValueError):
    pass


@dataclass
class Part:
    name: str
    filename: str | None
    content_type: str


@dataclass
class PartEnd:
    pass


@dataclass
class Done:
    pass


Event = Part | PartEnd | Done | bytes


def boundary_of(content_type: str) -> str | None:
    """The boundary of a `multipart/form-data` content type, None when it is not one."""
    kind, _, params = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        return None
    for m in _PARAM.finditer(";" + params):
        if m.group(1).lower() == "boundary":
            b = m.group(2) if m.group(2) is not None else m.group(3)
            return b if b and len(b) <= 70 else None
    return None


def _disposition(value: str) -> tuple[str, str | None]:
    kind, _, params = value.partition(";")
    if kind.strip().lower() != "form-data":
        raise MultipartError("a part is not form-data")
    name, filename = "", None
    for m in _PARAM.finditer(";" + params):
        v = m.group(2) if m.group(2) is not None else m.group(3)
        v = v.replace('\\"', '"')
        if m.group(1).lower() == "name":
            name = v
        elif m.group(1).lower() == "filename":
            filename = v
    return name, filename


class Reader:
    def __init__(self, boundary: str) -> None:
        self.delim = b"\r\n--" + boundary.encode("latin-1")
        self.buf = b"\r\n"
        self.state = "preamble"
        self.parts = 0

    def feed(self, data: bytes) -> list[Event]:
        self.buf += data
        out: list[Event] = []
        while True:
            if self.state == "preamble":
                i = self.buf.find(self.delim)
                if i < 0:
                    self.buf = self.buf[-(len(self.delim) - 1):]
                    return out
                self.buf, self.state = self.buf[i + len(self.delim):], "after"
            elif self.state == "after":
                if len(self.buf) < 2:
                    return out
                if self.buf.startswith(b"--"):
                    self.state, self.buf = "done", b""
                    out.append(Done())
                    return out
                # Transport padding (spaces, tabs) may follow a delimiter before its CRLF.
                stripped = self.buf.lstrip(b" \t")
                if not stripped.startswith(b"\r\n"):
                    if len(stripped) < 2 and len(self.buf) < 256:
                        return out
                    raise MultipartError("a delimiter is not followed by CRLF")
                self.buf, self.state = stripped[2:], "head"
            elif self.state == "head":
                i = self.buf.find(b"\r\n\r\n")
                if i < 0:
                    if len(self.buf) > HEAD_MAX:
                        raise MultipartError("a part's head is too large")
                    return out
                out.append(self._part(self.buf[:i]))
                self.buf, self.state = self.buf[i + 4:], "body"
            elif self.state == "body":
                i = self.buf.find(self.delim)
                if i < 0:
                    keep = len(self.delim) - 1
                    if len(self.buf) > keep:
                        out.append(self.buf[:-keep])
                        self.buf = self.buf[-keep:]
                    return out
                if i:
                    out.append(self.buf[:i])
                out.append(PartEnd())
                self.buf, self.state = self.buf[i + len(self.delim):], "after"
            else:  # done: the epilogue is ignored
                self.buf = b""
                return out

    def _part(self, raw: bytes) -> Part:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise MultipartError(f"more than {MAX_PARTS} parts")
        name, filename, ctype = None, None, "text/plain"
        for line in raw.decode("utf-8", "replace").split("\r\n"):
            key, sep, value = line.partition(":")
            if not sep:
                raise MultipartError("a part's head line has no colon")
            if key.strip().lower() == "content-disposition":
                name, filename = _disposition(value.strip())
            elif key.strip().lower() == "content-type":
                ctype = value.strip()
        if name is None:
            raise MultipartError("a part has no Content-Disposition")
        return Part(name, filename, ctype)
