"""End to end: what clients send at the edges (issue 31 items 3, 5, 6), on the sim.

- `tools` to a model whose engine lists no tools, Ollama's `think` to one that lists no
  thinking: a 400 in each API's shape from the hub (as images to one without vision).
- `/v1/models` and `/v1/models/{id}` in Anthropic's shape for Anthropic's clients (the
  official SDK's `models.list()` / `retrieve()`), OpenAI's for everyone else.
- A gzip body (`Content-Encoding: gzip`) is decoded; one that inflates past
  Hub__MaxBodyBytes is refused at its bound (413); another coding is a 415.
Both hub shapes: one process, and a main with a relay worker (which decodes first).
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import anthropic
import httpx
import pytest

from tests.harness.fleet import Fleet

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
LIMIT = 200_000  # Hub__MaxBodyBytes
USER = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}}
ANTHROPIC_TOOL = {"name": "weather", "input_schema": WEATHER["function"]["parameters"]}


def _post(f: Fleet, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f.url + path, json=body, timeout=30)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "workers"])
def fleet(request, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("edges"), token=TOKEN)
    try:
        f.start_hub({"Hub__Workers": str(request.param), "Hub__MaxBodyBytes": str(LIMIT)},
                    metrics=False)
        f.start_node("n1", {"Sim__TokensPerSecond": "0", "Sim__Models__0__Name": "plain",
                            "Sim__Models__0__Capabilities": "completion",
                            "Sim__Models__1__Name": "full"})
        f.wait_models("plain", "full")
        yield f
    finally:
        f.close()


# --- item 3: tools and think -------------------------------------------------------------

TOOLS = {
    "/v1/chat/completions": ({"messages": USER, "tools": [WEATHER], "max_tokens": 4},
                             lambda b: b["error"]["message"]),
    "/api/chat": ({"messages": USER, "tools": [WEATHER], "stream": False},
                  lambda b: b["error"]),
    "/v1/messages": ({"messages": USER, "tools": [ANTHROPIC_TOOL], "max_tokens": 4},
                     lambda b: b["error"]["message"]),
    "/v1/responses": ({"input": "hi", "tools": [{"type": "function", "name": "weather",
                                                 "parameters": WEATHER["function"]["parameters"]}]},
                      lambda b: b["error"]["message"]),
}


@pytest.mark.parametrize("route", list(TOOLS))
def test_tools_to_a_model_without_tools_are_a_400_in_the_apis_shape(fleet, route):
    body, message = TOOLS[route]
    r = _post(fleet, route, {"model": "plain", **body})
    assert r.status_code == 400, r.text
    assert "does not support tools (its engine lists completion)" in message(r.json())
    ok = _post(fleet, route, {"model": "full", **body})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("route", ["/api/chat", "/api/generate"])
def test_think_to_a_model_without_thinking_is_a_400(fleet, route):
    body = {"messages": USER} if route == "/api/chat" else {"prompt": "hi"}
    r = _post(fleet, route, {"model": "plain", "think": True, "stream": False, **body})
    assert r.status_code == 400 and "does not support thinking (its engine" in r.json()["error"]
    off = _post(fleet, route, {"model": "plain", "think": False, "stream": False, **body})
    assert off.status_code == 200, off.text


# --- item 5: /v1/models in Anthropic's shape ---------------------------------------------


def test_models_in_anthropics_shape_for_the_anthropic_sdk(fleet):
    c = anthropic.Anthropic(base_url=fleet.hub.url, api_key="x", max_retries=0, timeout=30)
    listed = c.models.list()
    ids = [m.id for m in listed.data]
    assert {"plain", "full"} <= set(ids)
    for m in listed.data:
        assert m.type == "model" and m.display_name == m.id and m.created_at.year >= 2024
    one = c.models.retrieve("full")
    assert (one.id, one.type) == ("full", "model")
    with pytest.raises(anthropic.NotFoundError):
        c.models.retrieve("nothing-here")
    # Paged as Anthropic pages: limit, after_id, has_more, first_id / last_id.
    h = {"anthropic-version": "2023-06-01"}
    page = httpx.get(fleet.hub.url + "/v1/models?limit=1", headers=h, timeout=10).json()
    assert len(page["data"]) == 1 and page["has_more"] is True
    assert page["first_id"] == page["last_id"] == page["data"][0]["id"]
    nxt = httpx.get(fleet.hub.url + f"/v1/models?limit=1&after_id={page['last_id']}",
                    headers=h, timeout=10).json()
    assert nxt["data"][0]["id"] != page["data"][0]["id"]
    bad = httpx.get(fleet.hub.url + "/v1/models?limit=0", headers=h, timeout=10)
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    # Everyone else: OpenAI's list.
    plain = httpx.get(fleet.hub.url + "/v1/models", timeout=10).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "model"


# --- item 6: gzip bodies -----------------------------------------------------------------


def _raw(fleet: Fleet, data: bytes, coding: str) -> httpx.Response:
    return httpx.post(fleet.hub.url + "/v1/chat/completions", content=data, timeout=30,
                      headers={"content-type": "application/json", "content-encoding": coding})


def test_a_gzip_body_is_decoded(fleet):
    body = json.dumps({"model": "full", "messages": USER, "max_tokens": 3}).encode()
    r = _raw(fleet, gzip.compress(body), "gzip")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_a_gzip_bomb_is_refused_at_the_body_bound(fleet):
    head = b'{"model":"full","messages":[{"role":"user","content":"'
    bomb = gzip.compress(head + b" " * (50 * LIMIT) + b'"}]}')  # 10 MB from ~10 KB
    assert len(bomb) < LIMIT // 10
    r = _raw(fleet, bomb, "gzip")
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_other_codings_are_a_415_and_broken_gzip_a_400(fleet):
    body = json.dumps({"model": "full", "messages": USER}).encode()
    r = _raw(fleet, body, "br")
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding"
    r = _raw(fleet, b"\x1f\x8b not gzip at all", "gzip")
    assert r.status_code == 400 and "gzip" in r.json()["error"]["message"]
