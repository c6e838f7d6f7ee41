"""Per-key limits and token counts on the hub's request path, in-process: the 429 in each
API's shape with its headers, tokens in the metrics and the audit line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio
from prometheus_client import generate_latest

from appliance.http.asgi import Receive, Scope, Send, read_body
from appliance.hub.run import Hub
from appliance.wire import NodeState
from tests.harness.engine_hub import M_READY, hub_before

ANSWER = {"id": "x", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


async def node(scope: Scope, receive: Receive, send: Send) -> None:
    await read_body(receive, 1 << 20)
    body = json.dumps(ANSWER).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def start(nursery: trio.Nursery, tmp: Path, env: dict[str, str]) -> tuple[Hub, str]:
    return await hub_before(nursery, tmp, node, {"Auth__Clients__0__Name": "team",
                                                 "Auth__Clients__0__Key": "k1", **env},
                            NodeState(name="n1", slots=4, models=M_READY))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}


async def test_limit_zero_is_a_429_in_each_apis_shape(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        _, url = await start(nursery, tmp_path, {"Auth__Clients__0__Rpm": "0"})
        auth = {"authorization": "Bearer k1"}
        async with httpx.AsyncClient(timeout=10, headers=auth) as c:
            o = await c.post(url + "/v1/chat/completions", json=CHAT)
            a = await c.post(url + "/v1/messages", json=CHAT)
            ol = await c.post(url + "/api/chat", json={**CHAT, "stream": False})
        for r in (o, a, ol):
            assert r.status_code == 429
            assert r.headers["x-should-retry"] == "false" and "retry-after" not in r.headers
            assert r.headers["x-ratelimit-limit-requests"] == "0"
        assert o.json()["error"]["code"] == "rate_limit_exceeded"
        assert o.json()["error"]["type"] == "requests"
        assert a.json()["error"]["type"] == "rate_limit_error"
        assert "Auth__Clients__N__Rpm" in ol.json()["error"]
        nursery.cancel_scope.cancel()


async def test_rpm_refusal_carries_retry_after_and_tokens_are_counted(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        hub, url = await start(nursery, tmp_path, {"Auth__Clients__0__Rpm": "1"})
        async with httpx.AsyncClient(timeout=10, headers={"x-api-key": "k1"}) as c:
            ok = await c.post(url + "/v1/chat/completions", json=CHAT)
            over = await c.post(url + "/v1/chat/completions", json=CHAT)
            anon = await c.post(url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": ""})
        assert ok.status_code == 200 and anon.status_code == 200
        assert over.status_code == 429
        assert 59 <= int(over.headers["retry-after"]) <= 61
        assert over.headers["x-ratelimit-remaining-requests"] == "0"
        assert over.headers["anthropic-ratelimit-requests-remaining"] == "0"
        scrape = generate_latest(hub.metrics_registry).decode()
        assert 'appliance_tokens_total{client="team",kind="input",model="m"}' in scrape
        assert 'appliance_tokens_total{client="anonymous",kind="input",model="m"}' in scrape
        lines = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
        served = [x for x in lines if x.get("status") == 200]
        assert served and all(x["input_tokens"] > 0 for x in served)
        refused = [x for x in lines if x.get("status") == 429]
        assert refused and "input_tokens" not in refused[0]
        st: dict[str, Any] = hub.tenants.status(0.0)
        assert st["team"]["limits"]["rpm"] == 1 and st["team"]["limited"] == 1
        nursery.cancel_scope.cancel()


async def test_a_negative_max_tokens_is_a_400(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        _, url = await start(nursery, tmp_path, {})
        async with httpx.AsyncClient(timeout=10, headers={"x-api-key": "k1"}) as c:
            r = await c.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": -5})
            huge = await c.post(url + "/v1/responses", json={"model": "m", "input": "x",
                                                             "max_output_tokens": 10**12})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_output_tokens"
        nursery.cancel_scope.cancel()


async def test_status_and_ctl_show_each_key(tmp_path: Path) -> None:
    from appliance import ctl

    async with trio.open_nursery() as nursery:
        _, url = await start(nursery, tmp_path, {"Auth__Clients__0__Tpm": "100000",
                                                 "Auth__Clients__0__Weight": "2"})
        async with httpx.AsyncClient(timeout=10, headers={"x-api-key": "k1"}) as c:
            assert (await c.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200
            st = (await c.get(url + "/api/status")).json()
            admin = (await c.get(url + "/admin/status")).json()
        nursery.cancel_scope.cancel()
    team = st["tenants"]["team"]
    assert team["limits"]["tpm"] == 100000 and team["limits"]["weight"] == 2
    assert team["minute"]["requests"] == 1 and team["minute"]["tokens"] > 0
    assert team["in_flight"] == 0 and team["queued"] == 0 and team["share"] == 1.0
    assert admin["tenants"]["team"]["requests"] == 1
    text = ctl.render("status", admin)
    header = next(line for line in text.splitlines() if line.startswith("CLIENT"))
    assert "TOK/MIN" in header and "SHARE" in header
    row = next(line for line in text.splitlines() if line.startswith("team"))
    assert "/100000" in row and "100%" in row


def test_history_has_tokens_per_second() -> None:
    from appliance.hub.observe.history import History, Reading

    h = History()
    h.sample(100.0, Reading({}, {}, {}, tokens={"input": 100.0, "output": 10.0}))
    point = h.sample(105.0, Reading({}, {}, {}, tokens={"input": 600.0, "output": 60.0}))
    assert point is not None and point["tokens_per_s"] == {"input": 100.0, "output": 10.0}
