"""Priority classes end to end: a real hub, two real `sim` nodes, real HTTP clients.

The issue's script (and the seed's live run): keys required; clients ops (essential),
team (normal), batch (background); two nodes with `Node__ModelSlots=1` and a slow token
rate, `sim-small` always on both (2 places in all, ReserveSlots=1).

1. A long team request takes one of the two places: batch is held while ops is answered;
   batch goes when the long request ends.
2. gpu-b paused through its own control API: batch, and a team request that sends
   `X-Priority: background`, both wait while ops and team are answered; gpu-b resumed:
   both go.
3. A SIGHUP lowers Priority__BackgroundMaxWaitSeconds to 2; with gpu-b paused again a
   batch request gets 503 `priority_wait_timeout` naming the client.
Then the audit lines carry essential, normal and background (the lowered one included),
and /metrics counts held, released and timed out.
"""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN, ADMIN = "node-secret", "admin-secret"
KEYS = {"ops": "key-ops", "team": "key-team", "batch": "key-batch"}
MODEL = "sim-small"
# 20 tokens/s: a 100-token answer takes 5 s, a 2-token one 0.1 s.
TPS = 20
LONG_TOKENS = 100


def hub_env_file(path, wait: int) -> None:
    path.write_text(f"Priority__BackgroundMaxWaitSeconds={wait}\n")


class Fleet:
    def __init__(self, procs, tmp_path, workers: int = 1) -> None:
        self.audit = tmp_path / "audit.jsonl"
        self.env_file = tmp_path / "hub.env"
        hub_env_file(self.env_file, 60)
        env = {
            "Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "127.0.0.1:0",
            "Node__HeartbeatSeconds": "0.5",
            "Hub__DrainSeconds": "5", "Auth__NodeToken": TOKEN, "Auth__AdminKey": ADMIN,
            "Auth__RequireKeys": "true", "Audit__Path": str(self.audit),
            "Priority__Enabled": "true", "Priority__ReserveSlots": "1",
            "Models__0__Name": MODEL, "Models__0__Replicas": "2",
            "Hub__Workers": str(workers),
        }
        for i, (name, cls) in enumerate((("ops", "essential"), ("team", "normal"), ("batch",
                                                                                    "background"))):
            env.update({f"Auth__Clients__{i}__Name": name, f"Auth__Clients__{i}__Key": KEYS[name],
                        f"Auth__Clients__{i}__Priority": cls})
        self.hub = procs.start("hub", env, args=["--env-file", str(self.env_file)],
                               wait=("hub", "metrics"))
        self.admin = httpx.Client(base_url=self.hub.url,
                                  headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
        node_env = {"Hub__Url": self.hub.url, "Auth__NodeToken": TOKEN, "Node__ModelSlots": "1",
                    "Node__MemoryMb": "4000", "Node__AnnounceSeconds": "1",
                    "Sim__TokensPerSecond": str(TPS)}
        self.nodes = {name: procs.node(name, node_env) for name in ("gpu-a", "gpu-b")}
        wait_until(lambda: self.ready_on() == {"gpu-a", "gpu-b"}, timeout=30,
                   what="sim-small ready on both nodes")

    def status(self) -> dict:
        r = self.admin.get("/api/status")
        assert r.status_code == 200, r.text
        return r.json()

    def ready_on(self) -> set[str]:
        for m in self.status()["models"]:
            if m["name"] == MODEL:
                return set(m["nodes"])
        return set()

    def node_status(self, name: str) -> str:
        return next(n["status"] for n in self.status()["nodes"] if n["name"] == name)

    def background(self) -> dict:
        return self.status()["priority"]["background"]

    def control(self, node: str, action: str) -> None:
        r = httpx.post(f"{self.nodes[node].url}/node/v1/{action}",
                       headers={"authorization": f"Bearer {TOKEN}"},
                       timeout=10)
        assert r.status_code == 200, r.text
        want = "paused" if action == "pause" else "up"
        wait_until(lambda: self.node_status(node) == want, what=f"{node} {want}")

    def chat(self, client: str, tokens: int = 2, headers: dict | None = None,
             path: str = "/v1/chat/completions") -> tuple[httpx.Response, float, float]:
        """(response, seconds it took, when it finished); `path` any inference route."""
        t = time.monotonic()
        body = {"model": MODEL, "max_tokens": tokens, "messages": [{"role": "user",
                                                                    "content": client}]}
        if path == "/v1/embeddings":
            body = {"model": MODEL, "input": client}
        r = httpx.post(f"{self.hub.url}{path}", timeout=120,
                       headers={"authorization": f"Bearer {KEYS[client]}", **(headers or {})},
                       json=body)
        done = time.monotonic()
        return r, done - t, done

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.hub.urls['metrics']}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name}{labels} not in the scrape")


# Hub__Workers=2: the same order, reserve and counts with a relay worker in the hub (most
# requests land on whichever process accepts first; hub/workers.py).
@pytest.mark.parametrize("workers", [1, 2])
def test_priority_classes_live(procs, tmp_path, workers):
    f = Fleet(procs, tmp_path, workers)
    assert f.status()["priority"]["reserve_slots"] == 1
    pool = ThreadPoolExecutor(6)

    # 1. A long team request takes one of the two places; batch is held, ops answered.
    long_team = pool.submit(f.chat, "team", LONG_TOKENS)
    wait_until(lambda: sum(n["in_flight"] for n in f.status()["nodes"]) == 1,
               what="the long request running")
    batch = pool.submit(f.chat, "batch")
    wait_until(lambda: f.background()["waiting"] == 1, what="batch held")
    r, took, _ = f.chat("ops")
    assert r.status_code == 200 and took < 3, (r.status_code, took)
    assert f.background()["waiting"] == 1 and not batch.done()
    r_long, _, long_done = long_team.result()
    r_batch, _, batch_done = batch.result()
    assert r_long.status_code == 200 and r_batch.status_code == 200
    assert batch_done >= long_done - 0.5  # it went when the long request ended
    assert f.background()["released"] == 1

    # 2. gpu-b paused by its owner: background waits (the lowered team request too).
    f.control("gpu-b", "pause")
    batch = pool.submit(f.chat, "batch")
    lowered = pool.submit(f.chat, "team", 2, {"X-Priority": "background"})
    # Every inference route is held alike: embeddings and Anthropic messages too.
    embed = pool.submit(f.chat, "batch", 2, None, "/v1/embeddings")
    messages = pool.submit(f.chat, "batch", 2, None, "/v1/messages")
    wait_until(lambda: f.background()["waiting"] == 4,
               what="batch, embeddings, messages and the lowered team request held")
    for client in ("ops", "team"):
        r, took, _ = f.chat(client)
        assert r.status_code == 200 and took < 3, (client, r.status_code, took)
    assert f.background()["waiting"] == 4
    resumed = time.monotonic()
    f.control("gpu-b", "resume")
    for fut in (batch, lowered, embed, messages):
        r, _, done = fut.result()
        assert r.status_code == 200 and done >= resumed
    assert f.background()["released"] == 5

    # 3. A shorter background wait (SIGHUP), gpu-b paused again: 503 naming the client.
    hub_env_file(f.env_file, 2)
    f.hub.signal(signal.SIGHUP)
    wait_until(lambda: f.status()["priority"]["background_max_wait_seconds"] == 2,
               what="the reload")
    f.control("gpu-b", "pause")
    r, took, _ = f.chat("batch")
    assert r.status_code == 503 and 1.5 <= took < 10, (r.status_code, took)
    err = r.json()["error"]
    assert err["code"] == "priority_wait_timeout" and "'batch'" in err["message"]
    assert "retry-after" not in r.headers
    f.control("gpu-b", "resume")

    # The audit trail and the scrape.
    lines = [json.loads(x) for x in f.audit.read_text().splitlines()]
    reqs = [x for x in lines if x.get("kind") == "request" and x.get("model") == MODEL]
    seen = {(x["client"], x["priority"], x["status"]) for x in reqs}
    assert {("ops", "essential", 200), ("team", "normal", 200), ("batch", "background", 200),
            ("team", "background", 200), ("batch", "background", 503)} <= seen, seen
    bg = '{class="background"}'
    assert f.metric("appliance_priority_reserve_slots") == 1
    assert f.metric("appliance_priority_held_total", bg) == 6
    assert f.metric("appliance_priority_released_total", bg) == 5
    assert f.metric("appliance_priority_timed_out_total", bg) == 1
    assert f.metric("appliance_priority_requests_total", '{class="essential"}') == 2
    assert f.metric("appliance_priority_waiting", bg) == 0
    assert f.metric("appliance_queue_timeouts_total", f'{{model="{MODEL}"}}') == 1
    pool.shutdown()


def test_priority_off_changes_nothing(procs, tmp_path):
    """Off by default: no `priority` in status, scrape or audit; background is not held."""
    audit = tmp_path / "audit.jsonl"
    hub = procs.hub({"Auth__NodeToken": TOKEN, "Auth__AdminKey": ADMIN, "Audit__Path": str(audit),
                     "Auth__Clients__0__Name": "batch", "Auth__Clients__0__Key": KEYS["batch"],
                     "Auth__Clients__0__Priority": "background", "Models__0__Name": MODEL})
    procs.node("gpu-a", {"Hub__Url": hub.url, "Auth__NodeToken": TOKEN, "Node__ModelSlots": "1",
                         "Node__MemoryMb": "4000", "Node__AnnounceSeconds": "1"})
    admin = {"authorization": f"Bearer {ADMIN}"}
    wait_until(lambda: any(n["status"] == "up" for n in httpx.get(hub.url + "/api/status",
                                                                  headers=admin).json()["nodes"]),
               what="gpu-a up")
    t = time.monotonic()
    r = httpx.post(f"{hub.url}/v1/chat/completions",
                   headers={"authorization": f"Bearer {KEYS['batch']}"},
                   json={"model": MODEL, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and time.monotonic() - t < 15
    assert "priority" not in httpx.get(hub.url + "/api/status", headers=admin).json()
    assert "appliance_priority" not in httpx.get(f"{hub.urls['metrics']}/metrics").text
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    assert all("priority" not in x for x in lines)
