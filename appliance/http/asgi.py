"""The small ASGI toolkit the hub, the node and the sim server share: a request's body
(bounded, decoded, its decoded cost held) and key in; JSON and text answers out.

Theory of operation: each of our servers is a plain ASGI callable dispatching on
(method, path) by hand -- no framework: the hot path is one dict lookup and a byte copy;
appliance/server/serve.py serves it. `read_body` reads a body within a bound
(BodyTooLarge past it). `decode_content` inflates a gzip body (`Content-Encoding`: SDK
users behind proxies, Go's and Java's clients) within that same bound, checked while
inflating (`decompress(data, max_length)` never makes more than the bound plus one byte:
a bomb costs no more than the bound, 413); another coding is a 415
`unsupported_encoding`, gzip that does not inflate a 400. `hold_decoded` holds what the
decoded JSON will cost against the listener's body budget (`BodyBudget`, the ASGI
extension BODY_BUDGET; the server holds the bytes already): the bytes plus ITEM_BYTES per
JSON item (each `{`, `[`, `,`, `:`, counted in C) -- a 33 MB body of a million tiny
messages decodes to ~300 MB. Over the budget: 503 `busy` with Retry-After, nothing
decoded; 413 `body_too_large` when the estimate alone is over the whole budget.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

import msgspec
import trio

from appliance.http.errors import ApiError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[..., Awaitable[None]]  # an ASGI app: await app(scope, receive, send)

_json = msgspec.json.Encoder()
JSON_HEADERS = [(b"content-type", b"application/json")]


T = TypeVar("T")


class BodyTooLarge(Exception):
    pass


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (name in lower case), or None."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def request_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries (`Authorization: Bearer KEY`, else Anthropic's `x-api-key`),
    or None. Header names are lower case (ASGI)."""
    auth = None
    xkey = None
    for k, v in headers:
        if k == b"authorization" and auth is None:
            auth = v.decode("latin-1")
        elif k == b"x-api-key" and xkey is None:
            xkey = v.decode("latin-1")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return xkey


def bearer(scope: Scope) -> str | None:
    """The key from `Authorization: Bearer KEY`, else `x-api-key`."""
    return request_key(scope["headers"])


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge past `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise trio.BrokenResourceError("client went away")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


def replay(body: bytes, receive: Receive) -> Receive:
    """`receive` giving `body` (already read, whole) first, then what `receive` gives."""
    given = False

    async def again() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def never() -> dict[str, Any]:
    """A `receive` after the body of a request no client holds: it never disconnects."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def decode_json(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """`body` decoded into the decoder's type; ApiError 400 in the API's words otherwise:
    `invalid_request` for the wrong shape, `invalid_json` for no JSON (nested too deeply
    included: msgspec skips unknown fields recursively, 100k nested arrays exhaust the
    stack)."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ApiError(400, "invalid_request", f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "body is not valid JSON: nested too deeply") from None


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = obj if isinstance(obj, bytes) else _json.encode(obj)
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + (headers
                                                                                            or [])})
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str | bytes,
                    content_type: bytes = b"text/plain; charset=utf-8") -> None:
    body = text.encode() if isinstance(text, str) else text
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type",
                                                                              content_type)]})
    await send({"type": "http.response.body", "body": body})


# --- a body's coding and its decoded cost ---------------------------------------------

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
    the body's own, or fewer when it came compressed: `decode_content`) against the
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
