"""The hub asks a node to send a stream it only assembles in one body (issue 26 item 7).

In-process: a hub in front of a stand-in node (an OpenAI-speaking engine kind) that notes
the headers it was sent and answers every generation as a stream written in one body with
its length, as node/whole.py sends a gathered answer. A generation the client wants whole
is sent with `x-appliance-whole` naming the hub's read bound (Hub__UpstreamReadSeconds);
a streamed one, or an Ollama route (its converter times the first token), without it; and
the answer assembled from the one body is the client's, with its usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from appliance.http.asgi import read_body
from tests.harness.engine_hub import hub_before

USER = [{"role": "user", "content": "hi"}]


def _sse(chat: bool) -> bytes:
    def chunk(piece: str, finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        return {"id": "c1", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1, "model": "m", "choices": [choice]}
    usage = {"id": "c1", "created": 1, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    events = [chunk("Hel"), chunk("lo"), chunk("", "stop"), usage]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + \
        b"data: [DONE]\n\n"


class Node:
    def __init__(self) -> None:
        self.asked: list[tuple[str, dict[str, str]]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await read_body(receive, 1 << 20)
        self.asked.append((scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]}))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body",
                    "body": _sse(scope["path"] == "/v1/chat/completions")})


@pytest.mark.parametrize("route,body,whole", [
    ("/v1/chat/completions", {"messages": USER}, True),
    ("/v1/completions", {"prompt": "x"}, True),
    ("/v1/messages", {"messages": USER, "max_tokens": 8}, True),
    ("/v1/responses", {"input": "x"}, True),
    ("/v1/chat/completions", {"messages": USER, "stream": True}, False),
    ("/api/chat", {"messages": USER, "stream": False}, False),
])
async def test_a_generation_the_hub_only_assembles_is_asked_whole(tmp_path: Path, route: str,
                                                                 body: dict[str, Any],
                                                                 whole: bool) -> None:
    node = Node()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, node, {"Hub__UpstreamReadSeconds": "30"})
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(url + route, json={"model": "m", **body})
        nursery.cancel_scope.cancel()
    assert r.status_code == 200
    headers = node.asked[0][1]
    assert headers.get("x-appliance-whole") == ("30" if whole else None)
    if route == "/v1/chat/completions" and whole:
        got = r.json()
        assert got["choices"][0]["message"]["content"] == "Hello"
        assert got["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert r.headers["content-length"] == str(len(r.content))
