"""The hub's client-facing errors, in each API's own shape.

Theory of operation: anything that refuses a request raises `RouteError` with a status,
a code from DESIGN section 9, a message, and optionally a Retry-After. The app renders it
in the shape of the API the request came in on: OpenAI `{"error": {"message", "type",
"code"}}` for /v1 routes, Ollama `{"error": "..."}` for /api routes.
"""

from __future__ import annotations

import msgspec

_enc = msgspec.json.Encoder()


# Refusals a retry of the same request cannot cure (DESIGN 9.1): they say so with
# `x-should-retry: false`, the header the OpenAI SDKs honour, and never carry Retry-After.
NO_RETRY = frozenset({"model_parked", "model_unplaceable"})


class RouteError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after

    def body(self, api: str) -> bytes:
        return error_body(api, self.status, self.code, self.message)

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.code in NO_RETRY:
            return [(b"x-should-retry", b"false")]
        if self.retry_after is None:
            return []
        return [(b"retry-after", str(max(1, int(round(self.retry_after)))).encode())]


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          503: "service_unavailable"}


def error_body(api: str, status: int, code: str, message: str) -> bytes:
    """`api` is "openai" or "ollama"."""
    if api == "ollama":
        return _enc.encode({"error": message})
    return _enc.encode({"error": {"message": message, "type": _TYPES.get(status, "server_error"), "code": code}})
