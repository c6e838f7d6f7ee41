"""The small ASGI toolkit the hub, the node and the sim server share.

Theory of operation: each of our servers is a plain ASGI callable dispatching on
(method, path) by hand -- no framework, because the hot path is one dict lookup and a
byte copy. This module owns reading a bounded request body and its key, and writing JSON and
text responses; appliance/server/serve.py serves such an app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

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


async def handle_lifespan(receive: Receive, send: Send) -> None:
    """Answer hypercorn's lifespan messages; our apps do their setup in the nursery."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def http_only(app: App) -> App:
    """Our apps see only `http` scopes: lifespan is answered here (setup happens in the
    nursery), anything else (websocket) is ignored."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await handle_lifespan(receive, send)

    return wrapped
