"""Benchmark: replicas that follow demand (issue 27, hub/decide/demand.py), one run.

A hub and two sim nodes, an on-demand model (`Models__0__Replicas=0`) that either node can
load (`Sim__Models__0__LoadSeconds` 2), each node `Sim__Parallel` = `Node__ModelSlots` = 4
at 100 tokens/s: a 50-token answer takes 0.5 s, so one replica serves ~8 a second. An open
loop of 12 requests a second for 40 s (a queue that grows on one replica), run twice on
fresh fleets: `Models__0__MaxReplicas=1` (one replica, as before) and `=2`. Figures: when
the second replica was ready (from the first request), the time to first token p50/p95
as the clients saw it (the queue wait: prefill is free here), and requests per node.

    .venv/bin/python bench/replicas.py [--rate 12] [--seconds 40]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench"
MODEL = "sim-small"
NODES = ("gpu-a", "gpu-b")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(q * len(xs)) - 1)] if xs else float("nan")


def run(max_replicas: int, rate: float, seconds: float) -> dict[str, float]:
    procs = Procs()
    try:
        import tempfile

        audit = os.path.join(tempfile.mkdtemp(prefix="replicas-"), "audit.jsonl")
        hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": audit,
                         "Models__0__Name": MODEL, "Models__0__MaxReplicas": str(max_replicas),
                         "Queue__MaxDepth": "5000", "Router__ActivationWaitSeconds": "120"})
        for n in NODES:
            procs.node(n, {"Hub__Url": hub.url, "Auth__NodeToken": TOKEN,
                           "Node__AnnounceSeconds": "1", "Sim__Models__0__Name": MODEL,
                           "Sim__Models__0__LoadSeconds": "2", "Sim__Parallel": "4",
                           "Node__ModelSlots": "4", "Sim__TokensPerSecond": "100",
                           "Node__MemoryMb": "4000"})
        wait_until(lambda: len(httpx.get(hub.url + "/api/status", timeout=5).json()["nodes"])
                   == 2, what="two nodes")
        ttft: list[float] = []
        ready_at: list[float] = []

        async def one(c: httpx.AsyncClient) -> None:
            t0 = time.perf_counter()
            async with c.stream("POST", hub.url + "/v1/chat/completions", json={
                    "model": MODEL, "max_tokens": 50, "stream": True,
                    "messages": [{"role": "user", "content": "hello"}]}) as r:
                first = False
                async for line in r.aiter_lines():
                    if not first and line.startswith("data: {"):
                        ttft.append(time.perf_counter() - t0)
                        first = True

        async def watch(start: float) -> None:
            async with httpx.AsyncClient(timeout=5) as c:
                while True:
                    st = (await c.get(hub.url + "/api/status")).json()
                    m = next((m for m in st["models"] if m["name"] == MODEL), None)
                    if m is not None and m["ready"] >= 2 and not ready_at:
                        ready_at.append(time.perf_counter() - start)
                    await trio.sleep(0.25)

        async def main() -> None:
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(
                    max_connections=2000)) as c, trio.open_nursery() as n:
                start = time.perf_counter()
                n.start_soon(watch, start)
                async with trio.open_nursery() as load:
                    for i in range(int(rate * seconds)):
                        await trio.sleep_until(trio.current_time() + 1 / rate) if i else None
                        load.start_soon(one, c)
                n.cancel_scope.cancel()

        trio.run(main)
        import json

        with open(audit) as f:
            lines = [x for x in map(json.loads, f) if x.get("kind") == "request"]
        per = Counter(x["node"] for x in lines)
        return {"second_ready_s": ready_at[0] if ready_at else float("nan"),
                "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
                **{f"requests_{n}": float(per.get(n, 0)) for n in NODES}}
    finally:
        procs.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--seconds", type=float, default=40.0)
    args = ap.parse_args()
    one = run(1, args.rate, args.seconds)
    two = run(2, args.rate, args.seconds)
    print(f"on-demand model, 2 sim nodes of 4 places (~8 answers/s each), {args.rate:g}/s for "
          f"{args.seconds:g} s; Models__0__MaxReplicas 1 vs 2")
    print(f"{'figure':18} {'max 1':>10} {'max 2':>10}")
    for k in one:
        print(f"{k:18} {one[k]:10.2f} {two[k]:10.2f}")


if __name__ == "__main__":
    main()
