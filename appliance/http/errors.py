"""The one error type of every server here, rendered in each API's own shape.

Every refusal is an `ApiError(status, code, message, retry_after, param)` -- a code from
DESIGN section 9 -- answered before the response starts (or as a stream's error event),
by whoever catches it, with `render(e, api_of(path))`: the one renderer, in the shape of
the API the path belongs to (OpenAI `{"error": {...}}` on /v1, Anthropic on /v1/messages,
Ollama `{"error": "..."}` elsewhere). The family, and where each is raised:

    ApiError                      http/errors.py: the decision cores, apps, the router
    +-- ListenerRefusal           server/limits.py: a listener rule broken mid-body;
        +-- RequestTimeout        the connection answers it (408) and closes
        +-- Busy                  (503 busy, Retry-After)

Not refusals, caught where they happen and turned into one of the above or a close:
h1/errors.ProtocolError(message, status_hint) -- RemoteProtocolError (the peer broke
HTTP/1.1: parse.BadRequest, body.BodyError, parse.BrokenResponse), LocalProtocolError
(our own step the state table refuses); client/upstream.UpstreamError (a node or engine
failed: the hub's relay.NotAnswered, "try another"); hub/fleet/ops.NodeRefused,
StaleLeader, NodeGone (the control API's answers). Plain data and msgspec only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, NamedTuple

from appliance.http.lines import LineEncoder

Api = Literal["openai", "ollama", "anthropic"]
Headers = list[tuple[bytes, bytes]]

_enc = LineEncoder()  # lines escaped: appliance/http/lines.py

# Refusals a retry of the same request cannot cure (DESIGN 9.1): they say so with
# `x-should-retry: false`, the header the OpenAI SDKs honour, and never carry Retry-After.
NO_RETRY = frozenset({"model_parked", "model_unplaceable"})


class ApiError(Exception):
    """A refusal, answered before the response starts (or as a stream's error event)."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None,
                 param: str | None = None, extra: Headers | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.param = param
        # Headers the refusal carries besides Retry-After (a 429's x-ratelimit-*), and the
        # OpenAI shape's `type` when the status's usual one is not it (a 429's "tokens").
        self.extra: Headers = extra or []
        self.kind = kind

    def body(self, api: str) -> bytes:
        return error_body(api, self.status, self.code, self.message, self.param, self.kind)

    def headers(self) -> Headers:
        if self.code in NO_RETRY:
            return [(b"x-should-retry", b"false"), *self.extra]
        if self.retry_after is None:
            return self.extra
        return [(b"retry-after", str(max(1, int(round(self.retry_after)))).encode()), *self.extra]


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 429: "requests", 503: "service_unavailable"}


def _openai_type(status: int) -> str:
    """A status with no entry above: the client's fault below 500, else the server's."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


# Anthropic's error types by status (its API reference, "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 408: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    529: "overloaded_error"}


def error_body(api: str, status: int, code: str, message: str, param: str | None = None,
               kind: str | None = None) -> bytes:
    """`api` is "openai", "ollama" or "anthropic" (anything else: OpenAI's shape)."""
    if api == "ollama":
        return _enc.encode({"error": message})
    if api == "anthropic":
        kind = _ANTHROPIC_TYPES.get(status, "api_error")
        return _enc.encode({"type": "error", "error": {"type": kind, "message": message}})
    kind = kind or _openai_type(status)
    return _enc.encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def api_of(path: str) -> Api:
    """The one path -> API map: whose error shape a request on `path` is answered in."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return "ollama"


class Rendered(NamedTuple):
    """A whole refusal: what a server writes (status line, headers, body) or an app sends."""

    status: int
    headers: Headers
    body: bytes


def render(e: ApiError, api: str, extra: Iterable[tuple[bytes, bytes]] = ()) -> Rendered:
    """The one renderer of a refusal: the body in `api`'s shape, its content type and length,
    the error's own headers (Retry-After, x-should-retry), then `extra` (a request id, a
    `connection: close`)."""
    body = e.body(api)
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *e.headers(), *extra]
    return Rendered(e.status, headers, body)


def describe(e: BaseException) -> str:
    """`Type: message`, the message taken down the cause chain: httpx over trio raises an
    empty ConnectError whose cause's cause is the SSL error that says why."""
    x: BaseException | None = e
    for _ in range(5):
        if x is None or str(x):
            break
        x = x.__cause__ or x.__context__
    return f"{type(e).__name__}: {x}" if x is not None and str(x) else type(e).__name__
