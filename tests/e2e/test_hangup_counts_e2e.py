"""End to end: a stream its client cancels is counted and charged (issue 31 item 1).

A client reads part of a stream from the sim (on each of the four APIs: chat and text
completions, Ollama's chat, Anthropic's messages, OpenAI's responses) and hangs up. The
audit line says 499 `client_disconnected` with the tokens relayed so far (within 10 % of
the pieces the client read, marked estimated: the engine's usage comes at the end), and
the key's tenant counts them: `served.output` and the minute's tokens in /api/status.
Both hub shapes: one process, and a main with a relay worker (`Hub__Workers=2`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
KEY = "sk-team"
READ = 100  # pieces the client reads before it hangs up
MAX = 600  # tokens asked for: at 400 tokens/s the stream would run 1.5 s
USER = [{"role": "user", "content": "tell me a long story"}]


def _openai_piece(obj: dict[str, Any]) -> bool:
    ch = (obj.get("choices") or [{}])[0]
    return bool(ch.get("text") or (ch.get("delta") or {}).get("content"))


# route -> (body, is this event a generated piece?)
ROUTES: dict[str, tuple[dict[str, Any], Callable[[dict[str, Any]], bool]]] = {
    "/v1/chat/completions": ({"messages": USER, "max_tokens": MAX, "stream": True},
                             _openai_piece),
    "/v1/completions": ({"prompt": "once upon a time", "max_tokens": MAX, "stream": True},
                        _openai_piece),
    "/api/chat": ({"messages": USER, "options": {"num_predict": MAX}, "stream": True},
                  lambda o: not o.get("done") and bool((o.get("message") or {}).get("content"))),
    "/v1/messages": ({"messages": USER, "max_tokens": MAX, "stream": True},
                     lambda o: o.get("type") == "content_block_delta"),
    "/v1/responses": ({"input": "tell me a long story", "max_output_tokens": MAX,
                       "stream": True},
                      lambda o: o.get("type") == "response.output_text.delta"),
}


def _tenant(f: Fleet) -> dict[str, Any]:
    got: dict[str, Any] = f.status()["tenants"]["team"]
    return got


def _line(f: Fleet, rid: str) -> dict[str, Any] | None:
    return next((x for x in f.audit("request") if x.get("request_id") == rid), None)


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "workers"])
def fleet(request, tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("hangup"), token=TOKEN)
    try:
        f.start_hub({"Audit__Path": f.audit_path, "Hub__Workers": str(request.param),
                     "Auth__RequireKeys": "true", "Auth__Clients__0__Name": "team",
                     "Auth__Clients__0__Key": KEY, "Auth__Clients__0__Tpm": "10000000"},
                    metrics=False)
        f.start_node("n1", {"Sim__TokensPerSecond": "400", "Sim__Models__0__Name": "m"})
        f.wait_models("m")
        yield f
    finally:
        f.close()


def _read_then_hang_up(url: str, route: str, rid: str) -> int:
    """Stream `route`, read READ generated pieces and close: the pieces read."""
    body, piece = ROUTES[route]
    headers = {"authorization": f"Bearer {KEY}", "x-api-key": KEY, "x-request-id": rid}
    n = 0
    with httpx.Client(timeout=30) as c, c.stream("POST", url + route, headers=headers,
                                                 json={"model": "m", **body}) as r:
        assert r.status_code == 200, r.read()
        buf = b""
        for data in r.iter_raw():
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line = line.removeprefix(b"data:").strip()
                if not line.startswith(b"{"):
                    continue
                if piece(json.loads(line)):
                    n += 1
            if n >= READ:
                return n  # leaving the block closes the connection mid-stream
    raise AssertionError(f"the stream ended after {n} pieces")


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_cancelled_stream_is_audited_499_with_what_was_relayed(fleet, route):
    before = _tenant(fleet)
    rid = f"hangup-{uuid.uuid4().hex[:8]}"
    read = _read_then_hang_up(fleet.hub.url, route, rid)
    line = wait_until(lambda: _line(fleet, rid), timeout=20, what="the audit line")
    assert (line["status"], line.get("error")) == (499, "client_disconnected"), line
    assert line.get("tokens_estimated") is True, line
    assert abs(line["output_tokens"] - read) <= read * 0.1, (read, line)
    after = wait_until(lambda: (lambda t: t if t["in_flight"] == 0 else None)(_tenant(fleet)),
                       what="the key's request settled")
    assert after["served"]["output"] - before["served"]["output"] == line["output_tokens"]
    # The minute window holds at least what was counted (the reservation stands).
    assert after["minute"]["tokens"] >= line["input_tokens"] + line["output_tokens"], after
