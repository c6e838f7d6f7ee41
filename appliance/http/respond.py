"""Sending a refusal: the one way every server here answers an `ApiError`.

Theory of operation: a JSON body in the shape of the request's API (`errors.error_body`),
the error's own headers (Retry-After, x-should-retry), and any the caller adds (a request
id). Only before the response has started; after it, a stream ends with
`stream.stream_error` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from appliance.http.errors import ApiError

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_api_error(send: Send, api: str, e: ApiError,
                         extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    headers = [(b"content-type", b"application/json"), *e.headers(), *extra]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": e.body(api)})
