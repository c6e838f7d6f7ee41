"""Faults with real processes (issue 11): a hub and three sim nodes, and every way a part
of it can go away under load. Every case asserts that each request the hub accepted got
a complete response or a clean error in its API's framing, that none hung past its
bound (the client's timeout), that each got exactly one audit line, and that the hub's
`appliance_requests_total` agrees.

One fleet is shared by the cases, in order (module scope), with short heartbeats (lost
after 3 x 0.5 s) and a short drain, so the whole file stays lean. The hub's port is
picked once by the OS and kept, because the nodes announce to it across its restart.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import free_port, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "fault-token"
NODES = ("gpu-a", "gpu-b", "gpu-c")
# Bound for any single request here: streams last ~2 s; a hung one would wait 600 s.
CLIENT_TIMEOUT = 30.0


def start_hub(f: Fleet):
    """The hub, on the port picked once for the module (the nodes announce to it across
    its restart)."""
    return f.start_hub({"Hub__Listen": f"127.0.0.1:{f.port}", "Audit__Path": f.audit_path,
                        "Hub__DrainSeconds": "1", "Hub__ReconnectMaxSeconds": "2",
                        "Node__HeartbeatSeconds": "0.5", "Queue__MaxDepth": "1000",
                        "Queue__MaxWaitSeconds": "60"}, metrics=False)


def start_node(f: Fleet, name: str):
    p = f.start_node(name, {"Hub__Url": f"http://127.0.0.1:{f.port}",
                            "Node__AnnounceSeconds": "1", "Node__ModelSlots": "8",
                            "Sim__Parallel": "8", "Sim__TokensPerSecond": "25",
                            "Sim__Models__0__Name": "sim-small",
                            "Sim__Models__0__LoadSeconds": "0"})
    httpx.post(p.url + "/node/v1/models/sim-small/load",
               headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    return p


def routable(f: Fleet) -> set[str]:
    st = f.status()
    up = {n["name"] for n in st["nodes"] if n["status"] == "up"}
    ready = set(st["models"][0]["nodes"]) if st["models"] else set()
    return up & ready


def wait_holding(f: Fleet, name: str, timeout: float = 20.0) -> None:
    """Until node `name` holds streams (a fixed pause from the start raced the dispatch
    on a loaded box: the fault then hit a node that held none)."""
    def holding() -> bool:
        return any(n["name"] == name and n["in_flight"] > 0 for n in f.status()["nodes"])
    wait_until(holding, timeout, f"{name} holding streams", interval=0.02)


def wait_routable(f: Fleet, *names: str, timeout: float = 30.0) -> None:
    wait_until(lambda: set(names) <= routable(f), timeout, f"{names} routable")


def requests_total(f: Fleet) -> float:
    return f.metric_sum("appliance_requests_total", url=f.url)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("faults"), token=TOKEN)
    f.port = free_port()
    try:
        start_hub(f)
        for n in NODES:
            start_node(f, n)
        wait_routable(f, *NODES)
        yield f
    finally:
        f.close()


def run_streams(url: str, n: int, *, api: str = "openai", tokens: int = 50,
                during=None) -> list[str]:
    """`n` concurrent streams; each outcome: "done", "error:<code>", "refused:<code>" or
    "LOST:<why>" (no complete response and no clean error: must never happen). `during`
    is called with an event set once every stream has its first line (a fault after it is
    not retried: a condition, where a fixed pause raced a loaded box)."""
    out: list[str] = [""] * n
    started = threading.Barrier(n + 1)
    under_way, firsts, lock = threading.Event(), [0], threading.Lock()

    def first_line() -> None:
        with lock:
            firsts[0] += 1
            if firsts[0] == n:
                under_way.set()

    def one(i: int) -> None:
        try:
            started.wait()
            if api == "openai":
                body = {"model": "sim-small", "stream": True, "max_tokens": tokens,
                        "messages": [{"role": "user", "content": f"fault {i}"}]}
                path = "/v1/chat/completions"
            else:
                body = {"model": "sim-small", "options": {"num_predict": tokens},
                        "messages": [{"role": "user", "content": f"fault {i}"}]}
                path = "/api/chat"
            with httpx.stream("POST", url + path, json=body, timeout=CLIENT_TIMEOUT) as r:
                if r.status_code != 200:
                    r.read()
                    err = r.json()["error"]
                    out[i] = f"refused:{err['code'] if isinstance(err, dict) else err[:40]}"
                    return
                lines = []
                for x in r.iter_lines():
                    if x.strip():
                        lines.append(x)
                        if len(lines) == 1:
                            first_line()
            if api == "openai":
                last = lines[-1][len("data: "):] if lines else ""
                if last == "[DONE]":
                    out[i] = "done"
                else:
                    out[i] = f"error:{json.loads(last)['error']['code']}"
            else:
                parts = [json.loads(x) for x in lines]  # every line valid NDJSON: no blank one
                last = parts[-1] if parts else {}
                if last.get("done"):
                    out[i] = "done"
                elif "error" in last:
                    out[i] = "error:" + ("node_lost" if "lost" in last["error"] else
                                         "shutting_down" if "shutting down" in last["error"]
                                         else last["error"][:40])
                else:
                    out[i] = f"LOST:ended without done or error: {last!r}"
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
            out[i] = f"LOST:{type(e).__name__}: {e}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()
    if during is not None:
        during(under_way)
    for t in threads:
        t.join(CLIENT_TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a request hung past its bound"
    return out


def check_accounting(fleet: Fleet, before_lines: int, before_total: float, n: int) -> list[dict]:
    """Exactly one audit line per request, and the hub's counter agrees."""
    wait_until(lambda: len(fleet.audit("request")) >= before_lines + n, 10, "audit lines")
    lines = fleet.audit("request")[before_lines:]
    assert len(lines) == n, lines
    assert requests_total(fleet) - before_total == n
    return lines


def test_three_equal_nodes_share_300_concurrent_requests(fleet):
    import trio

    n0, t0 = len(fleet.audit("request")), requests_total(fleet)
    codes: list[int] = []

    async def burst() -> None:
        limits = httpx.Limits(max_connections=310)
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT, limits=limits) as c:
            async def one(i: int) -> None:
                r = await c.post(fleet.url + "/v1/chat/completions", json={
                    "model": "sim-small", "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"spread {i}"}]})
                codes.append(r.status_code)

            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(one, i)

    trio.run(burst)
    assert codes == [200] * 300
    lines = check_accounting(fleet, n0, t0, 300)
    per_node = {n: sum(x["node"] == n for x in lines) for n in NODES}
    assert all(abs(c - 100) <= 15 for c in per_node.values()), per_node


def signal_under_streams(fleet: Fleet, name: str, sig: int):
    """run_streams' `during`: once node `name` holds streams under way, `sig` to it."""
    victim = fleet.node(name)

    def send(under_way: threading.Event):
        wait_holding(fleet, name)
        assert under_way.wait(20), "streams under way"  # a fault before them is retried
        victim.signal(sig)

    return send


def test_kill_9_of_a_node_under_streams(fleet):
    n0, t0 = len(fleet.audit("request")), requests_total(fleet)
    got = run_streams(fleet.url, 12, tokens=60,
                      during=signal_under_streams(fleet, "gpu-a", signal.SIGKILL))
    assert not [g for g in got if g.startswith("LOST")], got
    assert set(got) <= {"done", "error:node_lost"} and "error:node_lost" in got, got
    lines = check_accounting(fleet, n0, t0, 12)
    assert sum(x.get("error") == "node_lost" for x in lines) == got.count("error:node_lost")
    start_node(fleet, "gpu-a")
    wait_routable(fleet, *NODES)


def test_sigstop_of_a_node_ends_its_streams_with_node_lost(fleet):
    n0, t0 = len(fleet.audit("request")), requests_total(fleet)
    try:
        # Ollama's framing this time; streams of ~4 s, lost after 1.5 s of silence.
        got = run_streams(fleet.url, 9, api="ollama", tokens=100,
                          during=signal_under_streams(fleet, "gpu-b", signal.SIGSTOP))
    finally:
        fleet.node("gpu-b").signal(signal.SIGCONT)
    assert not [g for g in got if g.startswith("LOST")], got
    assert set(got) <= {"done", "error:node_lost"} and "error:node_lost" in got, got
    check_accounting(fleet, n0, t0, 9)
    wait_routable(fleet, *NODES)


def test_a_node_back_after_an_outage_longer_than_the_backoff_cap_is_routed_again(fleet):
    victim = fleet.node("gpu-c")
    victim.signal(signal.SIGKILL)
    victim.wait_exit(10)
    wait_until(lambda: "gpu-c" not in routable(fleet), 10, "gpu-c lost")
    time.sleep(4)  # twice Hub__ReconnectMaxSeconds: the hub's backoff is at its cap
    start_node(fleet, "gpu-c")
    # The announcement makes the hub dial at once (MockClock test: test_hub_nodes.py).
    wait_routable(fleet, *NODES, timeout=10)


def test_hub_restart_under_load_refuses_nothing_falsely(fleet):
    n0 = len(fleet.audit("request"))
    outcomes: list[str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=CLIENT_TIMEOUT) as c:
            while not stop.is_set():
                try:
                    r = c.post(fleet.url + "/api/chat", json={"model": "sim-small", "stream": False,
                                                             "messages": [{"role": "user",
                                                                           "content": "x"}]})
                except httpx.TransportError:
                    outcomes.append("not-accepted")  # the hub is down: nothing to account for
                    time.sleep(0.05)
                    continue
                outcomes.append("ok" if r.status_code == 200
                                else f"{r.status_code}:{r.json()['error'][:60]}")

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    wait_until(lambda: outcomes.count("ok") >= 4, 30, "the load served before the restart")
    fleet.hub.signal(signal.SIGTERM)
    assert fleet.hub.wait_exit(20) == 0
    start_hub(fleet)
    wait_until(lambda: outcomes[-20:].count("ok") >= 20, 30, "served again after the restart")
    stop.set()
    for w in workers:
        w.join(CLIENT_TIMEOUT + 10)
    answered = [o for o in outcomes if o != "not-accepted"]
    # Right after the start the nodes are still reporting: requests wait, never a false
    # 404 or model_unplaceable (the start-up grace).
    assert all(o == "ok" or o.startswith("503") for o in answered), set(answered)
    assert not [o for o in answered if "fits on no node" in o or "not found" in o], set(answered)
    wait_until(lambda: len(fleet.audit("request")) >= n0 + len(answered), 10, "audit lines")
    assert len(fleet.audit("request")) - n0 == len(answered)
    wait_routable(fleet, *NODES)


def test_sigterm_of_the_hub_ends_streams_longer_than_the_drain_with_shutting_down(fleet):
    n0 = len(fleet.audit("request"))

    def term(under_way: threading.Event):
        assert under_way.wait(20), "streams under way"  # each accepted and answering
        fleet.hub.signal(signal.SIGTERM)

    got = run_streams(fleet.url, 6, tokens=150, during=term)  # ~6 s streams, 1 s drain
    assert got == ["error:shutting_down"] * 6, got
    assert fleet.hub.wait_exit(20) == 0
    lines = fleet.audit("request")[n0:]
    assert len(lines) == 6 and all(x["error"] == "shutting_down" for x in lines)


def test_up_has_one_metrics_listener_honours_node_listen_and_feeds_the_watchdog(tmp_path):
    sock_path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(sock_path)
    s.settimeout(20)
    metrics_port, node_port = free_port(), free_port()
    fleet = Fleet()
    try:
        up = fleet.start("up", {"Hub__Listen": "127.0.0.1:0",
                                "Metrics__Listen": f"127.0.0.1:{metrics_port}",
                                "Node__Listen": f"127.0.0.1:{node_port}",
                                "Sim__TokensPerSecond": "0",
                                "NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "2000000"},
                         wait=("hub", "metrics", "node"))
        assert up.urls["node"] == f"http://127.0.0.1:{node_port}"
        assert up.urls["metrics"] == f"http://127.0.0.1:{metrics_port}"
        said = []
        deadline = time.monotonic() + 20
        while "WATCHDOG=1" not in said and time.monotonic() < deadline:
            said.append(s.recv(4096).decode())
        assert "READY=1" in said and "WATCHDOG=1" in said
        assert sum("metrics listening on" in x for x in up.stderr_lines) == 1
        assert httpx.get(up.urls["metrics"] + "/metrics", timeout=10).status_code == 200
        up.signal(signal.SIGTERM)
        assert up.wait_exit(20) == 0
    finally:
        fleet.close()
        s.close()


@pytest.mark.parametrize("where", ["file/audit.log", "missing/dir/audit.log"])
def test_audit_path_that_cannot_be_opened_exits_2_with_one_line(tmp_path, where):
    (tmp_path / "file").write_text("")
    r = Fleet().run("hub", {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                            "Audit__Path": str(tmp_path / where)})
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Audit__Path" in lines[0], lines
    assert not (tmp_path / "missing").exists()
