"""CORS preflights: the headers the official SDKs send from a browser are allowed."""

from __future__ import annotations

from typing import Any

from appliance.hub.api.routes import with_cors


async def _inner(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a preflight never reaches the app")


async def _preflight(origin: str, wanted: str) -> tuple[int, dict[bytes, bytes]]:
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    app = with_cors(_inner, ["http://app.example"])
    scope = {"type": "http", "method": "OPTIONS", "path": "/v1/messages",
             "headers": [(b"origin", origin.encode()),
                         (b"access-control-request-method", b"POST"),
                         (b"access-control-request-headers", wanted.encode())]}
    await app(scope, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"])


async def test_anthropic_browser_sdk_headers_are_allowed() -> None:
    # What @anthropic-ai/sdk sends with dangerouslyAllowBrowser: true.
    wanted = ["x-api-key", "anthropic-version", "anthropic-dangerous-direct-browser-access",
              "content-type", "x-stainless-os"]
    status, headers = await _preflight("http://app.example", ", ".join(wanted))
    allowed = {h.strip() for h in headers[b"access-control-allow-headers"].decode().split(",")}
    assert status == 204
    assert set(wanted) <= allowed


async def test_other_origins_get_no_allow_list() -> None:
    status, headers = await _preflight("http://evil.example", "x-api-key")
    assert status == 403 and b"access-control-allow-headers" not in headers
