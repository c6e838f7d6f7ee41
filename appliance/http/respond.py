"""Sending a refusal: the one way every server here answers an `ApiError`.

Theory of operation: `errors.render` makes the answer (a JSON body in the shape of the
request's API, the error's own headers -- Retry-After, x-should-retry -- and any the caller
adds: a request id); this sends it as the two ASGI messages. Only before the response has
started; after it, a stream ends with `stream.stream_error` instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from appliance.http.errors import ApiError, render

Send = Callable[[dict[str, Any]], Awaitable[None]]


async def send_api_error(send: Send, api: str, e: ApiError,
                         extra: Iterable[tuple[bytes, bytes]] = ()) -> None:
    r = render(e, api, extra)
    await send({"type": "http.response.start", "status": r.status, "headers": r.headers})
    await send({"type": "http.response.body", "body": r.body})
