"""The one error path: `errors.api_of` (path -> API) and `errors.render` (status, headers,
body in that API's shape), and the guarded ASGI app answering 408 and `busy` in the shape of
the path's API -- an Anthropic client on /v1/messages gets Anthropic's shape (it got
OpenAI's before)."""

from __future__ import annotations

import json
from typing import Any

import pytest

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


# The TLS listener's 408 and busy in Anthropic's shape: tests/server/test_h1.py
# test_408_and_busy_on_v1_messages_are_in_anthropics_shape runs on plain and TLS (one
# connection serves both since issue 19; guard_app is gone).
