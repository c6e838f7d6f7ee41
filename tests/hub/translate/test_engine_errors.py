"""An engine's failures reach clients as the hub's own error: in the API's shape, one
line of the engine's words, never a traceback, a file path, HTML or a huge body. The
pure converter is fuzzed with hypothesis; a fixed set of nasty answers goes through a
real hub in-process to every API. And the body the hub sends is its own JSON, whatever
content type the client gave (litellm's ollama provider and `curl -d` give none or a
form's)."""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config import load
from appliance.http.asgi import read_body
from appliance.hub.run import run_hub
from appliance.hub.translate.errors import MESSAGE_LIMIT, ErrorConverter, engine_error
from appliance.server.serve import serve
from appliance.wire import EngineInstall, ModelState, NodeState

TRACEBACK = """Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/llama_cpp/server/app.py", line 447, in chat
    return await run_in_threadpool(llama.create_chat_completion, **kwargs)
  File "/opt/venv/lib/python3.11/site-packages/llama_cpp/llama.py", line 1280, in _create
    raise RuntimeError(f"llama_decode returned {return_code}")
RuntimeError: llama_decode returned 1
"""
# What llama-cpp-python, FastAPI, proxies and broken engines have answered.
NASTY: list[tuple[int, str, bytes]] = [
    (500, "text/plain", TRACEBACK.encode()),
    (500, "application/json", json.dumps({"error": {"message": TRACEBACK,
                                                    "type": "internal_server_error"}}).encode()),
    (500, "application/json", json.dumps({"detail": TRACEBACK}).encode()),
    (422, "application/json", json.dumps({"detail": [{"loc": ["body", "messages"],
                                                      "msg": "Field required",
                                                      "type": "missing"}]}).encode()),
    (502, "text/html", b"<html><head><title>502 Bad Gateway</title></head><body><h1>502</h1>"
                       b"<p>/usr/share/nginx/html/50x.html</p></body></html>"),
    (500, "application/octet-stream", bytes(range(256)) * 8),
    (500, "text/plain", b"Internal Server Error"),
    (500, "text/plain", b"x" * (5 * 1024 * 1024)),
    (400, "application/json", json.dumps({"error": "failed to open /models/secret/x.gguf: "
                                                   "No such file or directory"}).encode()),
    (500, "application/json", b"{\"error\": " * 50000),
    (404, "application/json", b""),
    (503, "text/plain", TRACEBACK.encode()),  # the hub tries another node, then says why
]
# A file path of the kind tracebacks carry (two or more folders from the root or home).
PATH = re.compile(r"(^|[\s\"'(])~?/[\w.-]+/[\w.-]+")


def assert_clean(body: bytes) -> None:
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text and 'File "' not in text and "<html" not in text.lower()
    assert not PATH.search(text), text
    assert len(body) < 2 * MESSAGE_LIMIT + 200


# --- the pure converter --------------------------------------------------------------


def test_engine_error_picks_one_line_and_keeps_a_plain_code() -> None:
    assert engine_error(500, TRACEBACK.encode()) == ("engine_error",
                                                     "RuntimeError: llama_decode returned 1")
    code, msg = engine_error(400, NASTY[8][2])
    assert code == "invalid_request" and msg == ("failed to open <path>: No such file or "
                                                 "directory")
    assert engine_error(422, NASTY[3][2]) == ("invalid_request", "body.messages: Field required")
    assert engine_error(502, NASTY[4][2]) == ("engine_error", "502 Bad Gateway")
    assert engine_error(404, b"") == ("model_not_found", "the engine answered 404")
    node = json.dumps({"error": {"message": "model x not found on node n", "type": "x",
                                 "code": "model_not_found"}}).encode()
    assert engine_error(404, node) == ("model_not_found", "model x not found on node n")
    # A code that is no plain token (an int, a sentence) is not repeated.
    assert engine_error(500, b'{"error":{"code":500,"message":"boom"}}') == ("engine_error",
                                                                             "boom")
    # Routes and URLs are not file paths.
    assert engine_error(405, b'{"error":"GET serves /v1/models; see http://h:1/a/b"}')[1] == (
        "GET serves /v1/models; see http://h:1/a/b")
    long = engine_error(500, b"y" * 10_000)[1]
    assert len(long) == MESSAGE_LIMIT and long.endswith("…")


@pytest.mark.parametrize("api", ["openai", "ollama", "anthropic"])
@pytest.mark.parametrize(("status", "ctype", "body"), NASTY, ids=range(len(NASTY)))
def test_error_converter_answers_the_hubs_shape(api: str, status: int, ctype: str,
                                                body: bytes) -> None:
    conv = ErrorConverter(api, status)
    for i in range(0, len(body), 65536):
        assert conv.feed(body[i:i + 65536]) == b""
    out = conv.end()
    assert_clean(out)
    obj = json.loads(out)
    assert "error" in obj and (obj.get("type") == "error") == (api == "anthropic")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096) | st.text(max_size=2000).map(str.encode),
       st.integers(min_value=400, max_value=599),
       st.sampled_from(["openai", "ollama", "anthropic"]))
def test_error_converter_fuzz(body: bytes, status: int, api: str) -> None:
    conv = ErrorConverter(api, status)
    conv.feed(b"Traceback (most recent call last):\n  File \"/a/b/c.py\", line 1\n" + body)
    out = conv.end()
    json.loads(out)
    assert b"Traceback" not in out and b"/a/b/c.py" not in out
    assert len(out) < 2 * MESSAGE_LIMIT * 4 + 200  # MESSAGE_LIMIT characters, JSON-escaped


# --- through a real hub ----------------------------------------------------------------


class FailingNode:
    """Answers every request with one fixed failure; records the headers it was sent."""

    def __init__(self) -> None:
        self.answer: tuple[int, str, bytes] = (500, "text/plain", b"")
        self.seen: list[dict[bytes, bytes]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await read_body(receive, 1 << 20)
        self.seen.append(dict(scope["headers"]))
        status, ctype, body = self.answer
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype.encode())]})
        for i in range(0, len(body), 1 << 20):
            await send({"type": "http.response.body", "body": body[i:i + (1 << 20)],
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})


USER = [{"role": "user", "content": "hi"}]
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"model": "m", "messages": USER}),
    ("/v1/chat/completions", {"model": "m", "messages": USER, "stream": True}),
    ("/v1/embeddings", {"model": "m", "input": "hi"}),
    ("/api/chat", {"model": "m", "messages": USER}),
    ("/api/generate", {"model": "m", "prompt": "hi", "stream": False}),
    ("/v1/messages", {"model": "m", "messages": USER, "max_tokens": 5, "stream": True}),
    ("/v1/responses", {"model": "m", "input": "hi"}),
]


async def _fleet(nursery: trio.Nursery, tmp_path: Any, kind: str,
                 node: FailingNode) -> str:
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Audit__Path": str(tmp_path / "audit.log")})
    hub, (host, port) = await nursery.start(run_hub, cfg, trio.Event())
    nhost, nport = await nursery.start(partial(serve, node, "127.0.0.1:0", "fake"))
    h, _ = hub.registry.upsert("n", f"http://{nhost}:{nport}", static=True)
    hub.registry.apply_state(h, NodeState(name="n", slots=4, engines=[EngineInstall(kind)],
                                          models=[ModelState(name="m", state="ready")]))
    return f"http://{host}:{port}"


@pytest.mark.parametrize("kind", ["llamacpp", "ollama"])
async def test_no_engine_failure_reaches_a_client_raw(tmp_path: Any, kind: str) -> None:
    node = FailingNode()
    async with trio.open_nursery() as nursery:
        url = await _fleet(nursery, tmp_path, kind, node)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for answer in NASTY:
                node.answer = answer
                for path, body in ROUTES:
                    r = await client.post(path, json=body)
                    assert r.status_code == answer[0], (path, answer[:2])
                    assert r.headers["content-type"] == "application/json"
                    assert_clean(r.content)
                    msg = r.json()["error"]
                    msg = msg if isinstance(msg, str) else msg["message"]
                    assert msg and "\n" not in msg
        nursery.cancel_scope.cancel()


async def test_the_body_sent_is_json_whatever_the_client_said(tmp_path: Any) -> None:
    node = FailingNode()
    node.answer = (404, "application/json", b'{"error":"nope"}')
    async with trio.open_nursery() as nursery:
        url = await _fleet(nursery, tmp_path, "llamacpp", node)
        body = json.dumps({"model": "m", "messages": USER, "stream": False}).encode()
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            for headers in ({}, {"content-type": "application/x-www-form-urlencoded"},
                            {"content-type": "text/plain"}):
                for path in ("/api/chat", "/v1/chat/completions"):
                    node.seen.clear()
                    r = await client.post(path, content=body, headers=headers)
                    assert r.status_code == 404 and r.json()["error"]
                    (seen,) = node.seen
                    assert seen[b"content-type"] == b"application/json", (path, headers)
        nursery.cancel_scope.cancel()
