"""End to end: a real hub and three real nodes (sim engine with its prefix cache): the
second turn of a conversation lands on the first turn's node, and the engine says so."""

import json

import httpx
import pytest

from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
NODES = ("gpu-a", "gpu-b", "gpu-c")


def status(hub) -> dict:
    return httpx.get(hub.url + "/api/status", timeout=5).json()


def metric(hub, name: str, labels: str) -> float:
    text = httpx.get(hub.urls["metrics"] + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def fleet(procs, tmp_path):
    audit = tmp_path / "audit.jsonl"
    hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": str(audit)})
    common = {"Hub__Url": hub.url, "Auth__NodeToken": TOKEN, "Node__AnnounceSeconds": "1",
              "Sim__Models__0__Name": "sim-small", "Sim__CacheTokens": "32768",
              "Sim__PrefillTokensPerSecond": "0"}
    nodes = [procs.node(n, common) for n in NODES]
    for n in nodes:  # the model ready on all three: affinity has a choice to make
        r = httpx.post(n.url + "/node/v1/models/sim-small/load",
                       headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
    wait_ready(hub)
    return hub, audit, nodes


def wait_ready(hub) -> None:
    wait_until(lambda: len(next((m for m in status(hub)["models"] if m["name"] == "sim-small"),
                                {"nodes": []})["nodes"]) == 3, what="ready on three nodes")


def chat(c: httpx.Client, messages: list, **headers: str) -> dict:
    r = c.post("/v1/chat/completions", json={"model": "sim-small", "messages": messages,
                                             "max_tokens": 8}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def audit_nodes(audit) -> list[dict]:
    return [x for x in map(json.loads, audit.read_text().splitlines()) if x["kind"] == "request"]


def test_turn_two_lands_on_turn_ones_node_and_the_engine_reports_it_cached(fleet):
    hub, audit, _ = fleet
    convos = [[{"role": "system", "content": f"repository {i}: " + "def f(x): return x\n" * 120},
               {"role": "user", "content": "what does f do?"}] for i in range(6)]
    with httpx.Client(base_url=hub.url, timeout=30) as c:
        firsts = [chat(c, m) for m in convos]
        assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for a in firsts)
        turn1 = [x["node"] for x in audit_nodes(audit)]
        assert len(set(turn1)) >= 2  # different conversations spread over the fleet
        seconds = []
        for m, a in zip(convos, firsts, strict=True):
            m += [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "and g?"}]
            seconds.append(chat(c, m))
    lines = audit_nodes(audit)
    turn2 = [x["node"] for x in lines[len(convos):]]
    assert turn2 == turn1
    assert all(x["routing"] == "prefix" and x["cached_tokens"] > 0 for x in lines[len(convos):])
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in seconds)
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in seconds)
    routing = next(m for m in status(hub)["models"] if m["name"] == "sim-small")["routing"]
    assert routing["placed"]["prefix"] == len(convos)
    assert routing["cached_prompt_tokens"] == cached and routing["cache_hit_ratio"] > 0
    assert routing["confirmed_hits"] == routing["predicted_hits"] == len(convos)
    assert metric(hub, "appliance_routing_decisions_total",
                  'reason="prefix"') == len(convos)
    assert metric(hub, "appliance_cached_prompt_tokens_total", 'model="sim-small"') == cached
    assert metric(hub, "appliance_prompt_tokens_total", 'model="sim-small"') > cached
    # a streamed turn whose client asked for no usage: the hub still reads the engine's
    with httpx.Client(base_url=hub.url, timeout=30) as c:
        m = [*convos[0], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "h?"}]
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "sim-small", "messages": m, "max_tokens": 4, "stream": True}) as r:
            body = r.read().decode()
    assert '"usage"' not in body and "[DONE]" in body
    last = audit_nodes(audit)[-1]
    assert last["node"] == turn1[0] and last["routing"] == "prefix" and last["cached_tokens"] > 0
    assert metric(hub, "appliance_cached_prompt_tokens_total",
                  'model="sim-small"') == cached + last["cached_tokens"]


def test_a_named_session_stays_on_one_node(fleet):
    hub, audit, _ = fleet
    with httpx.Client(base_url=hub.url, timeout=30) as c:
        for i in range(6):  # short prompts: only the header keeps them together
            chat(c, [{"role": "user", "content": f"turn {i}"}], **{"x-session-id": "s-42"})
        for i in range(3):
            chat(c, [{"role": "user", "content": f"t {i}"}],
                 **{"x-claude-code-session-id": "x" * 4000})
    lines = audit_nodes(audit)
    assert len({x["node"] for x in lines[:6]}) == 1 and len({x["node"] for x in lines[6:]}) == 1
    assert all(x["routing"] == "session" for x in lines)
    assert "x" * 200 not in audit.read_text()  # a session value is never written anywhere
    assert metric(hub, "appliance_routing_decisions_total", 'reason="session"') == 9


def test_a_hub_restart_keeps_sessions_on_their_nodes(fleet, procs, tmp_path):
    """Rendezvous needs no state: a new hub (the nodes given statically) sends each named
    session where the old one did."""
    hub, audit, nodes = fleet

    def place_sessions(url: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            for i in range(8):
                chat(c, [{"role": "user", "content": "hi"}], **{"x-session-id": f"user-{i}"})

    place_sessions(hub.url)
    before = [x["node"] for x in audit_nodes(audit)]
    assert len(set(before)) >= 2
    hub.kill()
    audit2 = tmp_path / "audit2.jsonl"
    static = {f"Nodes__{i}__{k}": v for i, n in enumerate(nodes)
              for k, v in (("Name", NODES[i]), ("Url", n.url))}
    hub2 = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": str(audit2), **static})
    wait_ready(hub2)
    place_sessions(hub2.url)
    assert [x["node"] for x in audit_nodes(audit2)] == before

