"""The client's key: `Authorization: Bearer KEY`, else `x-api-key` (Anthropic's header)."""

from __future__ import annotations

from collections.abc import Iterable


def request_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries, or None. Header names are lower case (ASGI)."""
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
