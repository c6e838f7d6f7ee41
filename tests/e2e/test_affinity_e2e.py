"""End to end: a real hub and three real nodes (sim engine with its prefix cache): the
second turn of a conversation lands on the first turn's node, and the engine says so."""

import httpx
import pytest

from tests.harness.fleet import Fleet

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
NODES = ("gpu-a", "gpu-b", "gpu-c")


def metric(f: Fleet, name: str, labels: str) -> float:
    """The first sample of `name` whose labels include `labels`, 0 when none."""
    for line in f.scrape().splitlines():
        if line.startswith(f"{name}{{") and labels in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture
def fleet(procs, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    f.start_hub({"Audit__Path": f.audit_path})
    common = {"Node__AnnounceSeconds": "1", "Sim__Models__0__Name": "sim-small",
              "Sim__CacheTokens": "32768", "Sim__PrefillTokensPerSecond": "0"}
    for n in NODES:  # the model ready on all three: affinity has a choice to make
        r = httpx.post(f.start_node(n, common).url + "/node/v1/models/sim-small/load",
                       headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 200, r.text
    wait_ready(f)
    return f


def wait_ready(f: Fleet, hub: str | None = None) -> None:
    f.wait(lambda: len(f.ready_on("sim-small", hub)) == 3, "ready on three nodes")


ASK = {"max_tokens": 8, "timeout": 30}  # each turn of a conversation


def test_turn_two_lands_on_turn_ones_node_and_the_engine_reports_it_cached(fleet):
    f = fleet
    convos = [[{"role": "system", "content": f"repository {i}: " + "def f(x): return x\n" * 120},
               {"role": "user", "content": "what does f do?"}] for i in range(6)]
    firsts = [f.answer("sim-small", messages=m, **ASK) for m in convos]
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for a in firsts)
    turn1 = [x["node"] for x in f.audit("request")]
    assert len(set(turn1)) >= 2  # different conversations spread over the fleet
    seconds = []
    for m, a in zip(convos, firsts, strict=True):
        m += [{"role": "assistant", "content": a["choices"][0]["message"]["content"]},
              {"role": "user", "content": "and g?"}]
        seconds.append(f.answer("sim-small", messages=m, **ASK))
    lines = f.audit("request")
    turn2 = [x["node"] for x in lines[len(convos):]]
    assert turn2 == turn1
    assert all(x["routing"] == "prefix" and x["cached_tokens"] > 0 for x in lines[len(convos):])
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in seconds)
    cached = sum(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in seconds)
    routing = f.models()["sim-small"]["routing"]
    assert routing["placed"]["prefix"] == len(convos)
    assert routing["cached_prompt_tokens"] == cached and routing["cache_hit_ratio"] > 0
    assert routing["confirmed_hits"] == routing["predicted_hits"] == len(convos)
    assert metric(f, "appliance_routing_decisions_total",
                  'reason="prefix"') == len(convos)
    assert metric(f, "appliance_cached_prompt_tokens_total", 'model="sim-small"') == cached
    assert metric(f, "appliance_prompt_tokens_total", 'model="sim-small"') > cached
    # a streamed turn whose client asked for no usage: the hub still reads the engine's
    with httpx.Client(base_url=f.url, timeout=30) as c:
        m = [*convos[0], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "h?"}]
        with c.stream("POST", "/v1/chat/completions", json={
                "model": "sim-small", "messages": m, "max_tokens": 4, "stream": True}) as r:
            body = r.read().decode()
    assert '"usage"' not in body and "[DONE]" in body
    last = f.audit("request")[-1]
    assert last["node"] == turn1[0] and last["routing"] == "prefix" and last["cached_tokens"] > 0
    assert metric(f, "appliance_cached_prompt_tokens_total",
                  'model="sim-small"') == cached + last["cached_tokens"]


def test_a_named_session_stays_on_one_node(fleet):
    f = fleet
    for i in range(6):  # short prompts: only the header keeps them together
        f.answer("sim-small", messages=[{"role": "user", "content": f"turn {i}"}],
                 headers={"x-session-id": "s-42"}, **ASK)
    for i in range(3):
        f.answer("sim-small", messages=[{"role": "user", "content": f"t {i}"}],
                 headers={"x-claude-code-session-id": "x" * 4000}, **ASK)
    lines = f.audit("request")
    assert len({x["node"] for x in lines[:6]}) == 1 and len({x["node"] for x in lines[6:]}) == 1
    assert all(x["routing"] == "session" for x in lines)
    assert "x" * 200 not in open(f.audit_path).read()  # a session value is never written anywhere
    assert metric(f, "appliance_routing_decisions_total", 'reason="session"') == 9


def test_a_hub_restart_keeps_sessions_on_their_nodes(fleet, procs, tmp_path):
    """Rendezvous needs no state: a new hub (the nodes given statically) sends each named
    session where the old one did."""
    f = fleet

    def place_sessions(hub: str | None) -> None:
        for i in range(8):
            f.answer("sim-small", hub=hub, headers={"x-session-id": f"user-{i}"}, **ASK)

    place_sessions(None)
    before = [x["node"] for x in f.audit("request")]
    assert len(set(before)) >= 2
    f.hub.kill()
    audit2 = tmp_path / "audit2.jsonl"
    static = {f"Nodes__{i}__{k}": v for i, n in enumerate(NODES)
              for k, v in (("Name", n), ("Url", f.node(n).url))}
    f.start_hub({"Audit__Path": str(audit2), **static}, name="hub2")
    wait_ready(f, "hub2")
    place_sessions("hub2")
    assert [x["node"] for x in f.audit("request", audit2)] == before
