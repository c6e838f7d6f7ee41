"""A request body on its way to JSON: its `Content-Encoding` (gzip decoded within the body
bound, others refused) and what its decoded form costs the listener's body budget.

Theory of operation: some clients compress what they send (`Content-Encoding: gzip`: the
Python SDKs' users behind proxies, Go's and Java's HTTP clients on request). The hub
decodes gzip before it reads the JSON, and the decoded size is what counts: it must stay
within the same bound as a plain body (Hub__MaxBodyBytes), checked while inflating --
`decompressobj.decompress(data, max_length)` never makes more than the bound plus one
byte, so a bomb (a kilobyte that inflates to gigabytes) is refused at its bound (413)
having cost no more than that. `identity` (or none) is the body as it came; any other
coding is a 415 `unsupported_encoding`; gzip that does not inflate, a 400.

The decoded cost: the server holds a request's body bytes against `Hub__MaxBufferedBytes`
while the request lives (appliance/server/connection.py). Decoded JSON costs far more than
its bytes (a 33 MB body of a million tiny messages decodes to ~300 MB; a translated route
keeps a second copy), so before the router decodes a body it holds an estimate of the
decoded size too -- the bytes plus ITEM_BYTES per JSON item (each `{`, `[`, `,` and `:`),
counted in C by `bytes.count` -- through the server's `BodyBudget` (the ASGI extension
BODY_BUDGET). Over the bound: 503 `busy` with Retry-After, nothing decoded -- 413
`body_too_large` when the estimate alone is over the whole budget (a retry never fits).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from typing import Any, Protocol

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


# --- the decoded cost ---------------------------------------------------------------------

# The ASGI extension (scope["extensions"]) under which a server offers its BodyBudget.
BODY_BUDGET = "appliance.body_budget"
# Decoded cost of one JSON item, with room for a translation's copy: measured with
# tracemalloc, msgspec builds 59 bytes per item for a million {"role","content"} messages,
# 44 per number of a long array, ~70 for objects of unique keys.
ITEM_BYTES = 96
BUSY_RETRY_AFTER = 1.0


class BodyBudget(Protocol):
    @property
    def bound(self) -> int:
        """The listener's whole budget: a request over it alone never fits."""
        ...

    def hold(self, n: int) -> bool:
        """Hold `n` more bytes of the listener's body budget until this request ends;
        False (nothing held) when that would pass the bound."""
        ...

    def release(self, n: int) -> None:
        """`n` bytes of this request's body no longer held (a stream written to disk)."""
        ...


def release(scope: dict[str, Any] | None, n: int) -> None:
    """Give back `n` body bytes the app has written away (no budget offered: nothing)."""
    budget: BodyBudget | None = ((scope or {}).get("extensions") or {}).get(BODY_BUDGET)
    if budget is not None:
        budget.release(n)


def decoded_estimate(body: bytes) -> int:
    """The bytes a decoded `body` may cost: its own plus ITEM_BYTES per JSON item."""
    items = body.count(b"{") + body.count(b"[") + body.count(b",") + body.count(b":")
    return len(body) + ITEM_BYTES * items


def hold_decoded(scope: dict[str, Any] | None, body: bytes, held: int | None = None) -> None:
    """Hold the decoded estimate of `body` (less the `held` bytes the server already holds:
    the body's own, or fewer when it came compressed, http/encoding.py) against the
    server's budget; 503 `busy` when over, 413 `body_too_large` when the estimate alone is
    over the whole budget. No budget offered (a test's scope): nothing."""
    budget: BodyBudget | None = ((scope or {}).get("extensions") or {}).get(BODY_BUDGET)
    if budget is None:
        return
    estimate = decoded_estimate(body)
    extra = estimate - (len(body) if held is None else held)
    if extra > 0 and not budget.hold(extra):
        if estimate > budget.bound:
            raise ApiError(413, "body_too_large",
                           f"the request body decodes to an estimated {estimate} bytes, over "
                           f"the server's whole body budget of {budget.bound} "
                           "(MaxBufferedBytes): a retry would not fit either")
        raise ApiError(503, "busy", "the server holds too many decoded request bodies now; "
                       "retry shortly", retry_after=BUSY_RETRY_AFTER)
