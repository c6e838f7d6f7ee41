"""SIGHUP reload end to end: a real hub and node re-read their env file, as `systemctl reload` does.

The hub runs with `--env-file F`, keys required. F is rewritten -- the client's key
replaced, Priority__ReserveSlots raised, a model definition added (Models__0__MemoryMb) -- and a SIGHUP applies
all of it while a slow streamed request (20 tokens/s) is in flight: the new key works, the
old one is 401, the stream completes intact (the same words a fresh request gets). Then a
broken F (a bad value; an unknown key) is refused with exactly one log line naming the
variable, and the configuration before it stays. The node (env file by
APPLIANCE_ENV_FILE) applies Node__MaxConcurrency at once; its state, and the hub that
follows it, show the new value; a broken file is refused the same way.

Only settings in the env file can change by reload: the process environment overrides
the file, so these tests put everything they change in the file and nothing else there.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN, ADMIN = "node-secret", "admin-secret"
MODEL = "sim-small"
# 20 tokens/s: a 60-token answer streams for 3 s, long enough to straddle a reload.
TPS = 20
LONG_TOKENS = 60
REFUSED = "reload refused, keeping the old configuration"


def write_env(path, lines: dict[str, str]) -> None:
    path.write_text("# rewritten by the test\n" + "".join(f"{k}={v}\n" for k, v in lines.items()))


def hub_file(key: str, reserve: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"Auth__Clients__0__Name": "app", "Auth__Clients__0__Key": key,
            "Priority__Enabled": "true", "Priority__ReserveSlots": str(reserve), **(extra or {})}


ASK = {"max_tokens": 12, "timeout": 30}  # a short chat as client "app"


class Streamer(threading.Thread):
    """A streamed chat in the background; `first` is set once its first chunk is in."""

    def __init__(self, hub, key: str) -> None:
        super().__init__(daemon=True)
        self.hub, self.key = hub, key
        self.first = threading.Event()
        self.events: list[tuple[float, str]] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": LONG_TOKENS,
                "messages": [{"role": "user", "content": "a long answer"}]}
        try:
            with httpx.stream("POST", self.hub.url + "/v1/chat/completions", json=body, timeout=30,
                              headers={"authorization": f"Bearer {self.key}"}) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append((time.monotonic(), line[6:]))
                        self.first.set()
        except BaseException as e:  # reported by the test
            self.error = e
        finally:
            self.first.set()

    def text(self) -> str:
        out = []
        for _, data in self.events[:-1]:
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            out.extend(c["delta"].get("content") or "" for c in chunk["choices"])
        return "".join(out)


def model_def(admin) -> tuple[bool, int | None]:
    """(configured by Models__N, its Models__N__MemoryMb) as the admin API shows sim-small."""
    m = next(m for m in admin.get("/admin/models").json()["models"] if m["name"] == MODEL)
    return m["configured"], m["memory_mb"]


def count(proc, pattern: str) -> int:
    rx = re.compile(pattern)
    return sum(1 for line in proc.stderr_lines if rx.search(line))


def test_hub_sighup_applies_keys_priority_and_models_and_refuses_a_bad_file(procs, tmp_path):
    f = tmp_path / "hub.env"
    write_env(f, hub_file("key-a", 1))
    fleet = Fleet(tmp_path, procs=procs, token=TOKEN, admin=ADMIN)
    hub = fleet.start_hub({"Auth__RequireKeys": "true"}, metrics=False,
                          args=["--env-file", str(f)])
    admin = fleet.admin
    fleet.start_node("gpu-a", {"Node__AnnounceSeconds": "1", "Sim__TokensPerSecond": str(TPS)})
    fleet.wait(lambda: [n["status"] for n in fleet.status()["nodes"]] == ["up"], "node up")

    assert fleet.chat(MODEL, "reload", key="key-a", **ASK).status_code == 200  # activates sim-small
    before = admin.get("/api/status").json()
    assert before["priority"]["reserve_slots"] == 1
    assert model_def(admin) == (False, None)

    # A slow stream with the old key, in flight across the reload.
    s = Streamer(hub, "key-a")
    s.start()
    assert s.first.wait(20) and s.status == 200, s.error
    later_audit = tmp_path / "audit-after-restart.jsonl"
    write_env(f, hub_file("key-b", 2, {"Models__0__Name": MODEL, "Models__0__MemoryMb": "700",
                                       "Audit__Path": str(later_audit)}))
    hub.signal(signal.SIGHUP)
    # A setting the running hub cannot take is named in the same line, not silently kept.
    hub.wait_stderr(
        "configuration reloaded from .*hub.env; changed, applied only at the next start: "
        "Audit__Path$")
    reloaded_at = time.monotonic()

    assert fleet.chat(MODEL, "reload", key="key-b", **ASK).status_code == 200
    r = fleet.chat(MODEL, "reload", key="key-a", **ASK)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    after = admin.get("/api/status").json()
    assert after["priority"]["reserve_slots"] == 2
    assert model_def(admin) == (True, 700)
    assert not later_audit.exists()

    s.join(30)
    assert not s.is_alive() and s.error is None, s.error
    assert s.events[-1][1] == "[DONE]"
    assert any(t > reloaded_at for t,
               _ in s.events), "the stream ended before the reload; nothing was tested"
    # Intact: the same words a fresh request with the same input gets (the sim is deterministic).
    fresh = fleet.chat(MODEL, "a long answer", key="key-b", max_tokens=LONG_TOKENS, timeout=30)
    assert s.text() == fresh.json()["choices"][0]["message"]["content"]

    # Broken files: one line each naming the variable; the configuration before them stays.
    broken = [({**hub_file("key-c", 3), "Priority__ReserveSlots": "-1"},
               r"Priority__ReserveSlots='-1'"),
              ({**hub_file("key-c", 3), "Queue__MaxDeph": "5"},
               r"Queue__MaxDeph.*did you mean \"MaxDepth\"")]
    for n, (lines, says) in enumerate(broken, 1):
        write_env(f, lines)
        hub.signal(signal.SIGHUP)
        line = hub.wait_stderr(REFUSED + ".*" + says)
        assert "ERROR" in line
        assert fleet.chat(MODEL, "reload", key="key-b", **ASK).status_code == 200
        assert fleet.chat(MODEL, "reload", key="key-c", **ASK).status_code == 401
        assert admin.get("/api/status").json()["priority"]["reserve_slots"] == 2
        assert model_def(admin) == (True, 700)
        assert count(hub, REFUSED) == n
    assert count(hub, "configuration reloaded from") == 1
    assert not [x for x in hub.stderr_lines if "Traceback" in x]
    assert [n["status"] for n in admin.get("/api/status").json()["nodes"]] == ["up"]


def test_node_sighup_applies_max_concurrency_and_refuses_a_bad_file(procs, tmp_path):
    f = tmp_path / "node.env"
    write_env(f, {"Node__MaxConcurrency": "2"})
    fleet = Fleet(procs=procs, token=TOKEN)
    hub = fleet.start_hub(metrics=False)
    node = fleet.start_node("gpu-r", {"Node__AnnounceSeconds": "1",
                                      "APPLIANCE_ENV_FILE": str(f)})
    auth = {"authorization": f"Bearer {TOKEN}"}

    def node_state() -> dict:
        return httpx.get(node.url + "/node/v1/state", headers=auth, timeout=30).json()

    def seen_by_hub():
        nodes = httpx.get(hub.url + "/api/status", timeout=30).json()["nodes"]
        return nodes[0]["max_concurrency"] if nodes and nodes[0]["status"] == "up" else None

    assert node_state()["max_concurrency"] == 2
    wait_until(lambda: seen_by_hub() == 2, what="the hub following gpu-r")

    write_env(f, {"Node__MaxConcurrency": "5", "Hub__MaxBufferedBytes": "4096"})
    node.signal(signal.SIGHUP)
    node.wait_stderr(r"configuration reloaded: Node__MaxConcurrency 2 -> 5; listener limits now "
                     r".*Hub__MaxBufferedBytes=4096")
    assert node_state()["max_concurrency"] == 5
    r = httpx.post(node.url + "/v1/chat/completions", headers=auth, timeout=10,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 20_000}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "busy", r.text
    wait_until(lambda: seen_by_hub() == 5, what="the hub seeing the new limit")

    write_env(f, {"Node__MaxConcurrency": "0", "Hub__MaxBufferedBytes": "4096"})
    node.signal(signal.SIGHUP)
    node.wait_stderr(REFUSED + ".*Node__MaxConcurrency='0'")
    write_env(f, {"Node__MaxConcurency": "7", "Hub__MaxBufferedBytes": "4096"})
    node.signal(signal.SIGHUP)
    node.wait_stderr(REFUSED + ".*Node__MaxConcurency.*did you mean")
    assert count(node, REFUSED) == 2
    assert node_state()["max_concurrency"] == 5
    assert seen_by_hub() == 5
    assert count(node, "configuration reloaded") == 1
    assert not [x for x in node.stderr_lines if "Traceback" in x]


def test_hub_sighup_moves_the_listener_limits_of_every_hub_process(procs, tmp_path):
    """Hub__MaxBufferedBytes lowered by a reload: a new connection's big body is refused
    (503 `busy`) by whichever process accepts it (Hub__Workers=2); a connection kept alive
    from before the reload still serves a small request."""
    f = tmp_path / "hub.env"
    write_env(f, {"Hub__MaxBufferedBytes": "1000000"})
    fleet = Fleet(procs=procs, token=TOKEN)
    hub = fleet.start_hub({"Hub__Workers": "2"}, metrics=False, args=["--env-file", str(f)])
    fleet.start_node("gpu-a", {"Node__AnnounceSeconds": "1"})
    fleet.wait_up("gpu-a")
    big = {"model": MODEL, "max_tokens": 4,
           "messages": [{"role": "user", "content": "x" * 20_000}]}
    kept = httpx.Client(base_url=hub.url, timeout=30)
    r = kept.post("/v1/chat/completions", json=big)
    assert r.status_code == 200
    before = r.extensions["network_stream"].get_extra_info("client_addr")

    write_env(f, {"Hub__MaxBufferedBytes": "4096"})
    hub.signal(signal.SIGHUP)
    hub.wait_stderr(r"configuration reloaded from .*hub\.env$")  # not "at the next start"
    wait_until(lambda: count(hub, r"hub worker \d+: configuration reloaded") == 1,
               what="the worker reloaded")
    for _ in range(6):  # new connections, accepted by either process
        r = httpx.post(hub.url + "/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "busy", r.text
        assert r.headers["retry-after"] == "2"
    r = kept.post("/v1/chat/completions", json={**big, "messages": [{"role": "user",
                                                                     "content": "small"}]})
    assert r.status_code == 200, r.text
    # the same connection (its local address)
    assert r.extensions["network_stream"].get_extra_info("client_addr") == before
    assert not [x for x in hub.stderr_lines if "Traceback" in x]
