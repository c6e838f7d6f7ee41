"""The one error path: `errors.api_of` (path -> API) and `errors.render` (status, headers,
body in that API's shape), and the guarded ASGI app answering 408 and `busy` in the shape of
the path's API -- an Anthropic client on /v1/messages gets Anthropic's shape (it got
OpenAI's before)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from appliance.server.listener import Budget, Limits, LiveLimits, guard_app

from appliance.http.errors import ApiError, api_of, render
from appliance.http.respond import send_api_error


@pytest.mark.parametrize(("path", "api"), [
    ("/v1/messages", "anthropic"), ("/v1/messages/count_tokens", "anthropic"),
    ("/v1/messagesx", "openai"), ("/v1/chat/completions", "openai"), ("/v1/", "openai"),
    ("/api/chat", "ollama"), ("/node/v1/state", "ollama"), ("/health", "ollama"), ("/", "ollama"),
])
def test_one_map_from_path_to_api(path: str, api: str) -> None:
    assert api_of(path) == api


def test_render_gives_each_api_its_shape_with_length_and_the_errors_own_headers() -> None:
    e = ApiError(503, "busy", "held too much", retry_after=2)
    r = render(e, "anthropic", [(b"connection", b"close")])
    assert r.status == 503
    assert json.loads(r.body) == {"type": "error", "error": {"type": "overloaded_error",
                                                             "message": "held too much"}}
    assert r.headers == [(b"content-type", b"application/json"),
                         (b"content-length", str(len(r.body)).encode()),
                         (b"retry-after", b"2"), (b"connection", b"close")]
    assert json.loads(render(e, "ollama").body) == {"error": "held too much"}
    assert json.loads(render(e, "openai").body) == {"error": {
        "message": "held too much", "type": "service_unavailable", "param": None, "code": "busy"}}
    # A 4xx with no type of its own is the client's fault, never "server_error".
    timeout = json.loads(render(ApiError(408, "request_timeout", "slow"), "openai").body)
    assert timeout["error"]["type"] == "invalid_request_error"
    assert json.loads(render(ApiError(408, "request_timeout", "slow"), "anthropic").body)[
        "error"]["type"] == "invalid_request_error"


async def test_send_api_error_sends_what_render_made() -> None:
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    e = ApiError(404, "model_not_found", "no such model")
    await send_api_error(send, "ollama", e, [(b"x-request-id", b"r1")])
    r = render(e, "ollama", [(b"x-request-id", b"r1")])
    assert sent == [{"type": "http.response.start", "status": 404, "headers": r.headers},
                    {"type": "http.response.body", "body": r.body}]


async def _guarded(path: str, receive_gap: float, budget: int) -> tuple[int, dict[str, Any]]:
    """One request through `guard_app` (the TLS listener's rules), its app reading a body
    that arrives in two halves `receive_gap` seconds apart; the status and decoded body."""
    sent: list[dict[str, Any]] = []
    parts = [{"type": "http.request", "body": b"x" * 600, "more_body": True},
             {"type": "http.request", "body": b"x" * 600, "more_body": False}]

    async def receive() -> dict[str, Any]:
        msg = parts.pop(0)
        if not parts:
            await trio.sleep(receive_gap)
        return msg

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass

    live = LiveLimits(Limits(body_read_seconds=30))
    guarded = guard_app(app, live, Budget(budget))
    await guarded({"type": "http", "path": path, "headers": [], "state": {}}, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


async def test_guarded_408_and_busy_on_v1_messages_are_in_anthropics_shape(
        autojump_clock: Any) -> None:
    status, body = await _guarded("/v1/messages", receive_gap=60, budget=1 << 20)
    assert status == 408 and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    status, body = await _guarded("/v1/messages", receive_gap=0, budget=1000)
    assert status == 503 and body == {"type": "error", "error": {
        "type": "overloaded_error",
        "message": "the server holds too many request bodies now; retry shortly"}}
    # The same refusals elsewhere keep their APIs' shapes.
    assert (await _guarded("/v1/chat/completions", 0, 1000))[1]["error"]["code"] == "busy"
    assert (await _guarded("/api/chat", 60, 1 << 20))[1] == {
        "error": "request body not received within 30 s"}
