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

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.harness.fleet import Fleet
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


@pytest.fixture
def fleet(tmp_path, workers: int):
    f = Fleet(tmp_path, token=TOKEN, admin=ADMIN)
    try:
        f.env_file = tmp_path / "hub.env"
        hub_env_file(f.env_file, 60)
        env = {"Auth__RequireKeys": "true", "Audit__Path": f.audit_path,
               "Priority__Enabled": "true", "Priority__ReserveSlots": "1",
               "Models__0__Name": MODEL, "Models__0__Replicas": "2",
               "Hub__Workers": str(workers)}
        for i, (name, cls) in enumerate((("ops", "essential"), ("team", "normal"),
                                         ("batch", "background"))):
            env.update({f"Auth__Clients__{i}__Name": name, f"Auth__Clients__{i}__Key": KEYS[name],
                        f"Auth__Clients__{i}__Priority": cls})
        f.start_hub(env, args=["--env-file", str(f.env_file)])
        for name in ("gpu-a", "gpu-b"):
            f.start_node(name, {"Node__ModelSlots": "1", "Node__MemoryMb": "4000",
                                "Node__AnnounceSeconds": "1", "Sim__TokensPerSecond": str(TPS)})
        f.wait(lambda: f.ready_on(MODEL) == {"gpu-a", "gpu-b"},
               "sim-small ready on both nodes")
        yield f
    finally:
        f.close()


def background(f: Fleet) -> dict:
    return f.status()["priority"]["background"]


def control(f: Fleet, node: str, action: str) -> None:
    """gpu-b paused or resumed through its own control API, until the hub sees it."""
    r = httpx.post(f"{f.node(node).url}/node/v1/{action}",
                   headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert r.status_code == 200, r.text
    want = "paused" if action == "pause" else "up"
    f.wait(lambda: f.nodes()[node]["status"] == want, f"{node} {want}")


def timed(f: Fleet, client: str, tokens: int = 2, headers: dict | None = None,
          path: str = "/v1/chat/completions") -> tuple[httpx.Response, float, float]:
    """(response, seconds it took, when it finished) of `client`'s request on any route."""
    t = time.monotonic()
    if path == "/v1/embeddings":
        r = f.post(path, {"model": MODEL, "input": client}, key=KEYS[client], headers=headers,
                   timeout=120)
    else:
        r = f.chat(MODEL, client, key=KEYS[client], max_tokens=tokens, path=path,
                   headers=headers, timeout=120)
    done = time.monotonic()
    return r, done - t, done


# Hub__Workers=2: the same order, reserve and counts with a relay worker in the hub (most
# requests land on whichever process accepts first; hub/workers.py).
@pytest.mark.parametrize("workers", [1, 2])
def test_priority_classes_live(fleet, workers):
    f = fleet
    assert f.status()["priority"]["reserve_slots"] == 1
    pool = ThreadPoolExecutor(6)

    # 1. A long team request takes one of the two places; batch is held, ops answered.
    long_team = pool.submit(timed, f, "team", LONG_TOKENS)
    wait_until(lambda: sum(n["in_flight"] for n in f.status()["nodes"]) == 1,
               what="the long request running")
    batch = pool.submit(timed, f, "batch")
    wait_until(lambda: background(f)["waiting"] == 1, what="batch held")
    r, _, _ = timed(f, "ops")  # answered while batch waits (how fast: bench/refusals.py)
    assert r.status_code == 200, r.status_code
    assert background(f)["waiting"] == 1 and not batch.done()
    r_long, _, long_done = long_team.result()
    r_batch, _, batch_done = batch.result()
    assert r_long.status_code == 200 and r_batch.status_code == 200
    assert batch_done >= long_done - 0.5  # it went when the long request ended
    assert background(f)["released"] == 1

    # 2. gpu-b paused by its owner: background waits (the lowered team request too).
    control(f, "gpu-b", "pause")
    batch = pool.submit(timed, f, "batch")
    lowered = pool.submit(timed, f, "team", 2, {"X-Priority": "background"})
    # Every inference route is held alike: embeddings and Anthropic messages too.
    embed = pool.submit(timed, f, "batch", 2, None, "/v1/embeddings")
    messages = pool.submit(timed, f, "batch", 2, None, "/v1/messages")
    wait_until(lambda: background(f)["waiting"] == 4,
               what="batch, embeddings, messages and the lowered team request held")
    for client in ("ops", "team"):
        r, _, _ = timed(f, client)
        assert r.status_code == 200, (client, r.status_code)
    assert background(f)["waiting"] == 4
    resumed = time.monotonic()
    control(f, "gpu-b", "resume")
    for fut in (batch, lowered, embed, messages):
        r, _, done = fut.result()
        assert r.status_code == 200 and done >= resumed
    assert background(f)["released"] == 5

    # 3. A shorter background wait (SIGHUP), gpu-b paused again: 503 naming the client.
    hub_env_file(f.env_file, 2)
    f.hub.signal(signal.SIGHUP)
    wait_until(lambda: f.status()["priority"]["background_max_wait_seconds"] == 2,
               what="the reload")
    control(f, "gpu-b", "pause")
    r, took, _ = timed(f, "batch")
    # the 2 s wait, with slack for a busy box (the wait before the reload: 60 s and more)
    assert r.status_code == 503 and 1.5 <= took < 20, (r.status_code, took)
    err = r.json()["error"]
    assert err["code"] == "priority_wait_timeout" and "'batch'" in err["message"]
    assert "retry-after" not in r.headers
    control(f, "gpu-b", "resume")

    # The audit trail and the scrape.
    lines = f.audit()
    reqs = [x for x in lines if x.get("kind") == "request" and x.get("model") == MODEL]
    seen = {(x["client"], x["priority"], x["status"]) for x in reqs}
    (timed_out,) = [x for x in reqs if x["status"] == 503]
    assert timed_out["queue_ms"] >= 1500, timed_out  # why it was slow: the wait it gave up
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


def test_priority_off_changes_nothing(tmp_path):
    """Off by default: no `priority` in status, scrape or audit; background is not held."""
    f = Fleet(tmp_path, token=TOKEN, admin=ADMIN)
    try:
        f.start_hub({"Audit__Path": f.audit_path,
                     "Auth__Clients__0__Name": "batch", "Auth__Clients__0__Key": KEYS["batch"],
                     "Auth__Clients__0__Priority": "background", "Models__0__Name": MODEL})
        f.start_node("gpu-a", {"Node__ModelSlots": "1", "Node__MemoryMb": "4000",
                               "Node__AnnounceSeconds": "1"})
        f.wait_up("gpu-a")
        r = f.chat(MODEL, key=KEYS["batch"], max_tokens=2)
        assert r.status_code == 200
        assert "priority" not in f.status()
        assert "appliance_priority" not in f.scrape()
        assert all("priority" not in x for x in f.audit())
    finally:
        f.close()
