"""Soak: a hub and three sim nodes under load, one node killed and restarted mid-run (issue 11).

What it does, with real processes (the same helpers as the end-to-end tests):
1. Starts a hub and three announced sim nodes (`sim-small` ready on each).
2. Phase "burst": 1,000 concurrent non-streaming chat requests.
3. Phase "streams": 200 concurrent streaming chat requests; while they run, one node is
   killed with SIGKILL, then started again (same name) and must be routed again.
4. Measures again right after, 5 s after and 20 s after (the pools' idle connections
   expire after 15 s): fds must be back to their idle count.

It prints: requests completed, clean errors by code, lost requests (no complete response
and no clean error in the API's framing -- must be 0), p50/p99 latency per phase, hub
and node RSS, fds and CLOSE-WAIT sockets before, right after and a few seconds after
the load, audit lines against requests, and the spread over the nodes (each within 15%
of a third for the burst). Exit code 1 when a requirement fails.

Run: .venv/bin/python bench/soak.py [--burst 1000] [--streams 200]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "harness"))

from procfs import close_wait, fd_count, rss_kb, socket_inodes  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

TOKEN = "soak-token"
MODEL = "sim-small"
NODES = ("gpu-a", "gpu-b", "gpu-c")


def proc_stats(pid: int) -> dict:
    """RSS (MiB), open fds, and sockets in CLOSE-WAIT held by `pid`."""
    return {"rss_mb": round(rss_kb(pid) / 1024, 1), "fds": fd_count(pid),
            "close_wait": close_wait(inodes=socket_inodes(pid))}


def snapshot(procs: dict) -> dict:
    out = {}
    for name, p in procs.items():
        if p.popen.poll() is None:
            out[name] = proc_stats(p.pid)
    return out


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.lost: list[str] = []
        self.latencies: list[float] = []


async def one_request(c: httpx.AsyncClient, url: str, stream: bool, tally: Tally,
                      tokens: int) -> None:
    body = {"model": MODEL, "stream": stream, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "soak"}]}
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await c.post(url + "/v1/chat/completions", json=body)
            if r.status_code == 200 and r.json()["choices"][0]["message"]["content"]:
                tally.ok += 1
            else:
                tally.errors[f"{r.status_code} {r.json()['error']['code']}"] += 1
        else:
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    tally.errors[f"{r.status_code} {r.json()['error']['code']}"] += 1
                else:
                    last = ""
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            last = line[6:]
                    if last == "[DONE]":
                        tally.ok += 1
                    elif last and "error" in json.loads(last):
                        tally.errors["stream " + json.loads(last)["error"]["code"]] += 1
                    else:
                        tally.lost.append(
                            f"stream ended without [DONE] or an error event: {last[:80]!r}")
    except (httpx.HTTPError, ValueError, KeyError) as e:
        tally.lost.append(f"{type(e).__name__}: {e}")
    tally.latencies.append(time.perf_counter() - t0)


async def phase(url: str, n: int, stream: bool, tokens: int, during=None) -> tuple[Tally, float]:
    tally = Tally()
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as c:
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(one_request, c, url, stream, tally, tokens)
            if during is not None:
                await during()
    return tally, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1) if xs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=200)
    ap.add_argument("--tokens-per-second", default="40")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="appliance-soak-"))
    audit_path = tmp / "audit.log"
    procs = Procs()
    failures: list[str] = []
    try:
        hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": str(audit_path),
                         "Hub__DrainSeconds": "5",
                         "Queue__MaxDepth": "5000", "Queue__MaxWaitSeconds": "120",
                         "Hub__ReconnectMaxSeconds": "30"}, metrics=False)
        node_env = {"Hub__Url": hub.url, "Auth__NodeToken": TOKEN, "Node__AnnounceSeconds": "1",
                    "Node__ModelSlots": "64", "Sim__Parallel": "64",
                    "Sim__TokensPerSecond": args.tokens_per_second}
        nodes = {n: procs.node(n, node_env) for n in NODES}
        st = lambda: httpx.get(hub.url + "/api/status", timeout=10).json()  # noqa: E731
        wait_until(lambda: sum(n["status"] == "up" for n in st()["nodes"]) == 3, 30,
                   "three nodes up")
        for p in nodes.values():
            httpx.post(p.url + "/node/v1/models/sim-small/load",
                       headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        wait_until(lambda: len(st()["models"][0]["nodes"]) == 3, 30,
                   "sim-small ready on three nodes")

        def all_procs():
            return {"hub": hub, **nodes}

        before = snapshot(all_procs())
        burst, burst_s = trio.run(phase, hub.url, args.burst, False, 16)
        after_burst = snapshot(all_procs())
        audit_after_burst = len(audit_path.read_text().splitlines())

        victim = "gpu-b"
        restart = {}

        async def kill_and_restart():
            await trio.sleep(1.0)
            nodes[victim].signal(signal.SIGKILL)
            nodes[victim].wait_exit(10)
            await trio.sleep(1.0)
            t = time.monotonic()
            nodes[victim] = await trio.to_thread.run_sync(procs.node, victim, node_env)
            await trio.to_thread.run_sync(
                lambda: httpx.post(nodes[victim].url + "/node/v1/models/sim-small/load",
                                   headers={"authorization": f"Bearer {TOKEN}"}, timeout=30))
            while True:
                s = await trio.to_thread.run_sync(st)
                if any(n["name"] == victim and n["status"] == "up"
                       for n in s["nodes"]) and victim in s["models"][0]["nodes"]:
                    break
                await trio.sleep(0.05)
            restart["routable_after_s"] = round(time.monotonic() - t, 2)

        streams, streams_s = trio.run(phase, hub.url, args.streams, True, 100, kill_and_restart)
        right_after = snapshot(all_procs())
        time.sleep(5)
        settled = snapshot(all_procs())
        time.sleep(15)  # the pools' idle connections expire (15 s) and are swept
        idle_again = snapshot(all_procs())

        lines = [json.loads(x) for x in audit_path.read_text().splitlines()]
        reqs = [x for x in lines if x["kind"] == "request"]
        burst_nodes = Counter(x["node"] for x in reqs[:audit_after_burst] if x["kind"] == "request")
        total = args.burst + args.streams
        lost = burst.lost + streams.lost
        third = args.burst / 3
        spread_ok = all(abs(burst_nodes[n] - third) <= 0.15 * third for n in NODES)
        report = {
            "burst": {"requests": args.burst, "completed": burst.ok, "errors": dict(burst.errors),
                      "lost": len(burst.lost),
                      "seconds": round(burst_s, 2), "p50_ms": pct(burst.latencies, 0.5),
                      "p99_ms": pct(burst.latencies, 0.99),
                      "spread": dict(sorted(burst_nodes.items()))},
            "streams": {"requests": args.streams, "completed": streams.ok,
                        "errors": dict(streams.errors),
                        "lost": len(streams.lost), "seconds": round(streams_s, 2),
                        "p50_ms": pct(streams.latencies, 0.5),
                        "p99_ms": pct(streams.latencies, 0.99), "killed": victim, **restart},
            "audit_request_lines": len(reqs), "requests": total,
            "processes": {"before": before, "after_burst": after_burst, "right_after": right_after,
                          "after_5s": settled, "after_20s": idle_again},
        }
        print(json.dumps(report, indent=2))
        if lost:
            failures.append(f"{len(lost)} lost requests, e.g. {lost[:3]}")
        if len(reqs) != total:
            failures.append(f"{len(reqs)} audit lines for {total} requests")
        if not spread_ok:
            failures.append(f"burst spread {dict(burst_nodes)} not within 15% of a third each")
        for name in ("hub", "gpu-a", "gpu-c"):
            if settled[name]["close_wait"] > 5:
                failures.append(
                    f"{name}: {settled[name]['close_wait']} sockets in CLOSE-WAIT 5 s after the "
                    "load")
            if idle_again[name]["fds"] > before[name]["fds"] + 5:
                failures.append(
                    f"{name}: {idle_again[name]['fds']} fds 20 s after the load "
                    f"({before[name]['fds']} before)")
    finally:
        for p in procs.all:
            p.kill()
    for f in failures:
        print("FAIL:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
