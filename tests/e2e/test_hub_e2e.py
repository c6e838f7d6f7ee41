"""End to end: a real hub and real nodes (sim engine), driven by the official clients.

Processes are started as an operator would (`appliance hub`, `appliance node`) on ports
the OS picks, and stopped by pid. Nodes announce themselves to the hub with the node token.
"""

import json
import signal
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"


def status(hub):
    return httpx.get(hub.url + "/api/status", timeout=30).json()


def node_status(hub, name):
    for n in status(hub)["nodes"]:
        if n["name"] == name:
            return n["status"]
    return None


@pytest.fixture
def fleet(procs, tmp_path):
    """(hub, node a, node b, the audit file) of a Fleet: two sim nodes, both up."""
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    hub = f.start_hub({"Audit__Path": f.audit_path, "Router__ActivationWaitSeconds": "20"})
    common = {"Node__AnnounceSeconds": "1", "Sim__Models__0__Name": "sim-small",
              "Sim__Models__1__Name": "sim-embed"}
    a = f.start_node("gpu-a", common)
    b = f.start_node("gpu-b", common)
    f.wait_up("gpu-a", "gpu-b")
    return hub, a, b, Path(f.audit_path)


def test_openai_and_ollama_clients_through_the_hub(fleet):
    hub, a, b, audit = fleet
    oc = openai.OpenAI(base_url=hub.url + "/v1", api_key="none", max_retries=0)
    r = oc.chat.completions.create(model="sim-small", messages=[{"role": "user",
                                                                 "content": "hello"}])
    assert r.choices[0].message.content
    text = r.choices[0].message.content
    # Deterministic: the same request gives the same words.
    r2 = oc.chat.completions.create(model="sim-small", messages=[{"role": "user",
                                                                  "content": "hello"}])
    assert r2.choices[0].message.content == text

    chunks = list(oc.chat.completions.create(model="sim-small", stream=True, max_tokens=20,
                                             messages=[{"role": "user", "content": "stream me"}]))
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 10

    c = oc.completions.create(model="sim-small", prompt="once upon", max_tokens=5)
    assert c.choices[0].text
    e = oc.embeddings.create(model="sim-embed", input="vector")
    assert len(e.data[0].embedding) > 0
    ids = {m.id for m in oc.models.list().data}
    assert {"sim-small", "sim-embed"} <= ids

    ol = ollama.Client(host=hub.url)
    resp = ol.chat(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert resp.message.content
    parts = list(ol.chat(model="sim-small", messages=[{"role": "user", "content": "hi"}],
                         stream=True))
    assert parts[-1].done and len(parts) > 2
    g = ol.generate(model="sim-small", prompt="why is the sky blue")
    assert g.response
    emb = ol.embed(model="sim-embed", input="x")
    assert len(emb.embeddings[0]) > 0
    assert "sim-small" in {m.model for m in ol.list().models}
    assert any(m.model == "sim-small" for m in ol.ps().models)

    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    reqs = [x for x in lines if x["kind"] == "request"]
    assert len(reqs) >= 9 and all(x["status"] == 200 for x in reqs)
    assert {x["node"] for x in reqs} <= {"gpu-a", "gpu-b"}
    assert "priority" not in reqs[0]  # priority is off


def test_two_nodes_share_load_and_bad_input_is_answered(fleet):
    hub, a, b, audit = fleet
    with httpx.Client(base_url=hub.url, timeout=30) as c:
        # Load the model on both nodes first (through the node control API).
        for n in (a, b):
            r = httpx.post(n.url + "/node/v1/models/sim-small/load",
                           headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
            assert r.status_code == 200, r.text
        wait_until(lambda: len(next(m for m in status(hub)["models"]
                                    if m["name"] == "sim-small")["nodes"]) == 2,
                   what="ready on both nodes")
        import concurrent.futures as cf

        body = {"model": "sim-small", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 30}
        with cf.ThreadPoolExecutor(8) as ex:
            rs = list(ex.map(lambda _: c.post("/v1/chat/completions", json=body), range(16)))
        assert all(r.status_code == 200 for r in rs)
        # Each answer's audit line is written as its request ends: wait for all 16.
        def served() -> list[str] | None:
            n = [json.loads(x)["node"] for x in audit.read_text().splitlines()
                 if json.loads(x)["kind"] == "request"]
            return n if len(n) >= 16 else None

        nodes = wait_until(served, what="16 audit lines")
        assert nodes.count("gpu-a") >= 2 and nodes.count("gpu-b") >= 2, nodes

        # Bad input, each in the API's own shape; the hub keeps serving.
        r = c.post("/v1/chat/completions", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.post("/v1/chat/completions", json=[1, 2])
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = c.post("/v1/chat/completions", json={"model": 7})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = c.post("/api/chat", json={"messages": []})
        assert r.status_code == 400 and isinstance(r.json()["error"], str)
        r = c.post("/v1/chat/completions", json={"model": "no-such-model"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/api/generate", json={"model": "no-such-model"})
        assert r.status_code == 404 and "not found" in r.json()["error"]
        r = c.get("/v1/chat/completions")
        assert r.status_code == 405
        r = c.get("/nowhere")
        assert r.status_code == 404
        r = c.post("/api/nodes/announce", json={"name": "x", "url": "http://x:1"},
                   headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401
        r = c.post("/api/nodes/announce", json={"name": "x", "url": "not a url"},
                   headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 400
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200

        # A pull goes to both sim nodes at once (modelops.py): Ollama's progress lines, each
        # with its node, and the last line says how each node did.
        progress = list(ollama.Client(host=hub.url, timeout=30).pull("sim-pulled", stream=True))
        assert progress[0].status == "pulling manifest" and len(progress) > 10
        lines = [json.loads(x) for x in c.post("/api/pull", json={"model": "sim-pulled"}).text
                 .splitlines()]
        assert {x.get("node") for x in lines[:-1]} == {"gpu-a", "gpu-b"}
        for n in ("gpu-a", "gpu-b"):
            mine = [x for x in lines if x.get("node") == n]
            assert mine[0]["status"] == "pulling manifest"
            assert any(x["completed"] == x["total"] for x in mine if x.get("total"))
        last = json.loads(c.post("/api/pull", json={"model": "sim-pulled",
                                                    "stream": False}).text)
        assert progress[-1].status == last["status"] == "success" and lines[-1] == last
        assert last["nodes"] == {"gpu-a": "success", "gpu-b": "success"}


def test_body_too_large(procs):
    hub = Fleet(procs=procs).start_hub({"Hub__MaxBodyBytes": "1000"}, metrics=False)
    r = httpx.post(hub.url + "/v1/chat/completions", json={"model": "m", "pad": "x" * 5000},
                   timeout=10)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert httpx.get(hub.url + "/health", timeout=30).status_code == 200


def test_keys_required(procs):
    hub = Fleet(procs=procs, admin="adm").start_hub(
        {"Auth__RequireKeys": "true", "Auth__Clients__0__Name": "team",
         "Auth__Clients__0__Key": "k-team", "Auth__Clients__0__Models": "sim-*"}, metrics=False)
    r = httpx.post(hub.url + "/v1/chat/completions", json={"model": "m"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(hub.url + "/api/chat", json={"model": "m"}, headers={"x-api-key": "bad"},
                   timeout=10)
    assert r.status_code == 401 and "unknown API key" in r.json()["error"]
    # A model the client may not use reads exactly like one that does not exist.
    r = httpx.post(hub.url + "/v1/chat/completions", json={"model": "other"},
                   headers={"authorization": "Bearer k-team"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(hub.url + "/api/status", timeout=30).status_code == 401
    assert httpx.get(hub.url + "/api/status", headers={"authorization": "Bearer adm"},
                     timeout=30).status_code == 200
    assert httpx.get(hub.url + "/health", timeout=30).status_code == 200


def test_node_killed_paused_resumed(fleet):
    hub, a, b, audit = fleet
    oc = openai.OpenAI(base_url=hub.url + "/v1", api_key="none", max_retries=0)
    msg = [{"role": "user", "content": "hi"}]
    for n in (a, b):
        httpx.post(n.url + "/node/v1/models/sim-small/load",
                   headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    wait_until(lambda: len(next(m for m in status(hub)["models"]
                                if m["name"] == "sim-small")["nodes"]) == 2,
               what="ready on both nodes")

    # Paused through the owner's control API: left out, then back.
    r = httpx.post(a.url + "/node/v1/pause", headers={"authorization": f"Bearer {TOKEN}"},
                   timeout=10)
    assert r.status_code == 200
    wait_until(lambda: node_status(hub, "gpu-a") == "paused", what="gpu-a paused")
    for _ in range(4):
        oc.chat.completions.create(model="sim-small", messages=msg)
    reqs = [json.loads(x) for x in audit.read_text().splitlines()]
    assert [x["node"] for x in reqs if x["kind"] == "request"][-4:] == ["gpu-b"] * 4
    httpx.post(a.url + "/node/v1/resume", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
    wait_until(lambda: node_status(hub, "gpu-a") == "up", what="gpu-a up again")

    # Killed: marked lost, requests keep working on the other node.
    b.signal(signal.SIGKILL)
    b.wait_exit(10)
    wait_until(lambda: node_status(hub, "gpu-b") == "lost", timeout=10, what="gpu-b lost")
    for _ in range(3):
        assert oc.chat.completions.create(model="sim-small",
                                          messages=msg).choices[0].message.content
    events = [json.loads(x) for x in audit.read_text().splitlines()]
    assert any(e["kind"] == "node_lost" and e["node"] == "gpu-b" for e in events)
    m = httpx.get(hub.urls["metrics"] + "/metrics", timeout=30).text
    assert 'appliance_node_up{node="gpu-b"} 0.0' in m
    assert 'appliance_node_lost{node="gpu-b"} 1.0' in m
    assert 'appliance_node_up{node="gpu-a"} 1.0' in m
    # Requests by client/model/status, latency and time to first byte, in flight.
    assert 'appliance_requests_total{client="anonymous",model="sim-small",status="200"}' in m
    assert 'appliance_request_duration_seconds_count{model="sim-small"}' in m
    assert 'appliance_time_to_first_byte_seconds_count{model="sim-small"}' in m
    assert 'appliance_in_flight{model="sim-small"} 0.0' in m
    assert "appliance_node_paused" in m and "appliance_node_heartbeat_age_seconds" in m
    # The API port serves the same scrape.
    assert 'appliance_node_lost{node="gpu-b"} 1.0' in httpx.get(hub.url + "/metrics",
                                                                timeout=30).text


def one_slow_node(procs, hub_env: dict, tokens_per_second: str):
    """A hub and one announced sim node at a slow token rate, sim-small loaded and ready."""
    f = Fleet(procs=procs, token=TOKEN)
    hub = f.start_hub(hub_env, metrics=False)
    a = f.start_node("gpu-a", {"Node__AnnounceSeconds": "1",
                               "Sim__TokensPerSecond": tokens_per_second})
    f.wait_up("gpu-a")
    httpx.post(a.url + "/node/v1/models/sim-small/load",
               headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    wait_until(lambda: status(hub)["models"] and status(hub)["models"][0]["nodes"], what="ready")
    return hub, a


def test_node_dies_mid_stream_ends_with_error_event(procs, tmp_path):
    hub, a = one_slow_node(procs, {}, "20")
    got = []
    with httpx.stream("POST", hub.url + "/v1/chat/completions", timeout=20,
                      json={"model": "sim-small", "stream": True, "max_tokens": 400,
                            "messages": [{"role": "user", "content": "long"}]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            got.append(line)
            if len(got) == 6:
                a.signal(signal.SIGKILL)
    data = [x for x in got if x.startswith("data: ")]
    last = json.loads(data[-1][6:])
    assert last["error"]["code"] == "node_lost"
    assert httpx.get(hub.url + "/health", timeout=30).status_code == 200


def test_sigterm_drains_and_exits_0(procs):
    f = Fleet(procs=procs)
    assert f.stop(f.start_hub(metrics=False)) == 0


def test_up_serves_a_chat_with_the_simulator_and_says_so(procs):
    up = Fleet(procs=procs).start("up", {"Hub__Listen": "127.0.0.1:0",
                                         "Sim__TokensPerSecond": "0"}, wait=("hub",))
    assert any("SIMULATED" in line for line in up.stderr_lines)
    oc = openai.OpenAI(base_url=up.urls["hub"] + "/v1", api_key="none", max_retries=0)
    r = oc.chat.completions.create(model="sim-small", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content and r.system_fingerprint == "appliance-sim"
    up.signal(signal.SIGTERM)
    assert up.wait_exit(20) == 0


def test_sigterm_lets_in_flight_work_finish_then_exits_0(procs):
    hub, _ = one_slow_node(procs, {"Hub__DrainSeconds": "20"}, "40")
    events = []
    with httpx.stream("POST", hub.url + "/v1/chat/completions", timeout=30,
                      json={"model": "sim-small", "stream": True, "max_tokens": 60,
                            "messages": [{"role": "user", "content": "long"}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
                if len(events) == 3:
                    hub.signal(signal.SIGTERM)  # ~1.4 s of tokens still to come
                    hub.wait_stderr("stopping: draining", timeout=10)
                    # Stopped accepting: a new connection is refused while this one drains.
                    try:
                        httpx.get(hub.url + "/health", timeout=2)
                        refused = False
                    except httpx.TransportError:
                        refused = True
    assert refused
    assert events[-1] == "data: [DONE]" and len(events) >= 60
    assert hub.wait_exit(20) == 0
