"""A request body's `Content-Encoding`: gzip decoded within the body bound, others refused.

Theory of operation: some clients compress what they send (`Content-Encoding: gzip`: the
Python SDKs' users behind proxies, Go's and Java's HTTP clients on request). The hub
decodes gzip before it reads the JSON, and the decoded size is what counts: it must stay
within the same bound as a plain body (Hub__MaxBodyBytes), checked while inflating --
`decompressobj.decompress(data, max_length)` never makes more than the bound plus one
byte, so a bomb (a kilobyte that inflates to gigabytes) is refused at its bound (413)
having cost no more than that. `identity` (or none) is the body as it came; any other
coding is a 415 `unsupported_encoding`; gzip that does not inflate, a 400. The caller
counts the decoded bytes against the listener's body budget (http/budget.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from appliance.http.asgi import BodyTooLarge
from appliance.http.errors import ApiError

# zlib's window bits for the gzip container (16 + the largest window).
GZIP_WBITS = 31
# Members of a multi-member gzip body a request may have (RFC 1952 allows a sequence);
# a client sends one.
MAX_MEMBERS = 16


def content_coding(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The body's coding, lower case ("" for none or identity); several: joined by ","."""
    codings = [v.decode("latin-1").strip().lower() for k, v in headers
               if k == b"content-encoding"]
    words = [w.strip() for c in codings for w in c.split(",") if w.strip()]
    return ",".join(w for w in words if w != "identity")


def decode_content(headers: Iterable[tuple[bytes, bytes]], body: bytes, limit: int) -> bytes:
    """`body` as sent, decoded when gzip (BodyTooLarge once it passes `limit` bytes);
    ApiError 415 for a coding the hub does not decode, 400 for gzip that does not inflate."""
    for k, _ in headers:
        if k == b"content-encoding":
            break
    else:
        return body  # the common case: no coding, nothing to read twice
    coding = content_coding(headers)
    if not coding:
        return body
    if coding not in ("gzip", "x-gzip"):
        raise ApiError(415, "unsupported_encoding",
                       f"Content-Encoding {coding[:40]!r} is not supported (send gzip, or none)")
    return gunzip(body, limit)


def gunzip(data: bytes, limit: int) -> bytes:
    """Inflate a gzip body, never making more than `limit` + 1 bytes."""
    out: list[bytes] = []
    size = 0
    for _ in range(MAX_MEMBERS):
        d = zlib.decompressobj(GZIP_WBITS)
        try:
            piece = d.decompress(data, limit - size + 1)
        except zlib.error:
            raise ApiError(400, "invalid_request", "body is not valid gzip") from None
        size += len(piece)
        if size > limit or d.unconsumed_tail:
            raise BodyTooLarge(size)
        out.append(piece)
        if not d.eof:
            raise ApiError(400, "invalid_request", "body is not valid gzip: it ends early")
        data = d.unused_data
        if not data.strip(b"\0"):
            return b"".join(out)
    raise ApiError(400, "invalid_request", f"body has more than {MAX_MEMBERS} gzip members")
