"""Benchmark: per-key limits, the fair share inside a class, preemption (issue 21), one run.

Real processes on loopback: a hub and one sim node (`Node__MaxConcurrency` = `Sim__Parallel`
= 8, `Sim__TokensPerSecond` 100: a 50-token answer takes 0.5 s, so the fleet serves about
16 such requests a second). Four parts, each on a fresh hub:

1. fairness, one heavy key and one light key in class normal: the light key alone
   (1.2 requests/s, streamed), then with the heavy key sending 20x its rate (24/s, more
   than the fleet serves: its backlog grows all along). Figures: the light key's p95 time
   to first token and p95 total, alone and with the heavy key, and their ratio.
2. equal keys: three keys, each keeping 16 requests outstanding (all backlogged), for
   70 s. Token service per key (input + 2 x output, the engine's usage as the client
   received it) over every 60 s window starting each second: Jain's index, and the
   largest gap between two keys against the VTC bound (2 x the largest request's cost).
3. a key with Tpm=6000 under 50 concurrent requests (each with max_tokens 100), each
   client honouring Retry-After, for 75 s: the tokens (engine usage) of the requests
   admitted in any 60 s window against the limit + one request's cap; each 429's
   Retry-After against when the next request of the key was really admitted.
4. preemption (Priority__Preempt): four background requests stream already, four wait
   for their first byte (a 40 kB prompt prefilled at Sim__PrefillTokensPerSecond=4000,
   ~2.5 s); an essential request arrives: its time to first token, the background
   requests answered 503 preempted, and started streams cut (must be 0).
Then the hub's own cost: CPU per request with a key that has Rpm/Tpm set vs anonymous.

    .venv/bin/python bench/tenants.py [PART...]   # e.g. 1 6
6. (issue 27) a full fleet of two nodes x two places: the light key's p95 time to first
   token beside 16 long streams of a heavy key, and what the heavy key's throughput pays
   for the place kept back (decide/share.py).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from procfs import cpu_seconds  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench"
MODEL = "sim-small"
PARALLEL = 8


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.95 * len(xs)) - 1)] if xs else float("nan")


class Fleet:
    def __init__(self, hub_env: dict[str, str], clients: dict[str, dict[str, str]]) -> None:
        self.procs = Procs()
        env = {"Auth__NodeToken": TOKEN, "Audit__Path": "/dev/null", "Queue__MaxDepth": "5000",
               "Queue__MaxWaitSeconds": "300", **hub_env}
        self.audit = env["Audit__Path"]
        for i, (name, extra) in enumerate(clients.items()):
            env.update({f"Auth__Clients__{i}__Name": name, f"Auth__Clients__{i}__Key": name,
                        **{f"Auth__Clients__{i}__{k}": v for k, v in extra.items()}})
        self.hub = self.procs.hub(env, metrics=False)
        self.node = node = self.procs.node("gpu-a", {
            "Hub__Url": self.hub.url, "Auth__NodeToken": TOKEN, "Node__AnnounceSeconds": "1",
            "Sim__Models__0__Name": MODEL, "Sim__TokensPerSecond": "100",
            "Sim__Parallel": str(PARALLEL), "Node__MaxConcurrency": str(PARALLEL),
            "Node__ModelSlots": str(PARALLEL), "Sim__PrefillTokensPerSecond": "4000"})
        httpx.post(node.url + f"/node/v1/models/{MODEL}/load", timeout=30,
                   headers={"authorization": f"Bearer {TOKEN}"}).raise_for_status()
        wait_until(lambda: any(m["name"] == MODEL and m["ready"] for m in httpx.get(
            self.hub.url + "/api/status", timeout=5).json()["models"]), what="model ready")

    def close(self) -> None:
        self.procs.close()


class Result:
    def __init__(self, key: str, sent: float) -> None:
        self.key, self.sent = key, sent
        self.status = 0
        self.ttft = math.nan
        self.total = math.nan
        self.usage = (0, 0)
        self.retry_after = 0.0
        self.body = ""


async def chat(c: httpx.AsyncClient, url: str, key: str, *, max_tokens: int = 50,
               content: str = "hello there", stream: bool = False,
               cls: str | None = None) -> Result:
    r = Result(key, time.monotonic())
    headers = {"authorization": f"Bearer {key}"}
    if cls:
        headers["x-priority"] = cls
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": content}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with c.stream("POST", url + "/v1/chat/completions", json=body,
                        headers=headers) as resp:
        r.status = resp.status_code
        chunks = []
        async for line in resp.aiter_lines():
            if line.strip() and math.isnan(r.ttft):
                r.ttft = time.monotonic() - r.sent
            chunks.append(line)
        r.body = "\n".join(chunks)
        r.retry_after = float(resp.headers.get("retry-after", 0) or 0)
    r.total = time.monotonic() - r.sent
    if r.status == 200:
        events = [json.loads(x[6:]) for x in chunks if x.startswith("data: {")] if stream else [
            json.loads(r.body)]
        for ev in events:
            u = ev.get("usage")
            if u:
                r.usage = (u.get("prompt_tokens", 0), u.get("completion_tokens", 0))
    return r


async def open_loop(c: httpx.AsyncClient, url: str, key: str, rate: float, seconds: float,
                    out: list[Result], **kw: Any) -> None:
    async def one() -> None:
        out.append(await chat(c, url, key, **kw))

    async with trio.open_nursery() as n:
        for i in range(int(rate * seconds)):
            await trio.sleep_until(start + i / rate) if i else None
            n.start_soon(one)
    return None


start = 0.0


async def closed_loop(c: httpx.AsyncClient, url: str, key: str, workers: int, seconds: float,
                      out: list[Result], honour_retry: bool = False, **kw: Any) -> None:
    end = trio.current_time() + seconds

    async def worker() -> None:
        while trio.current_time() < end:
            r = await chat(c, url, key, **kw)
            out.append(r)
            if r.status == 429 and honour_retry:
                await trio.sleep(r.retry_after)

    async with trio.open_nursery() as n:
        for _ in range(workers):
            n.start_soon(worker)


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=400))


def run(fn: Callable[[], Awaitable[None]]) -> None:
    trio.run(fn)


# --- 1. fairness: heavy and light -------------------------------------------------------

class Cpu:
    """CPU seconds of processes over a span: their share of one core."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.t0, self.c0 = time.monotonic(), {k: cpu_seconds(p) for k, p in pids.items()}

    def shares(self) -> dict[str, float]:
        wall = time.monotonic() - self.t0
        return {k: (cpu_seconds(p) - self.c0[k]) / wall for k, p in self.pids.items()}


def light_breakdown(audit: str, since: float, until: float) -> dict[str, float]:
    """The light key's p95 of the hub's own figures over its requests sent in [since,
    until) (audit `ts`, wall clock): queue_ms (admission), node_wait_ms (send -> first byte
    from the node), ttfb_ms (the hub's arrival -> first byte)."""
    lines = []
    with open(audit) as fh:
        for x in map(json.loads, fh):
            if x.get("kind") == "request" and x.get("client") == "light":
                lines.append(x)
    out = {}
    for k in ("queue_ms", "node_wait_ms", "ttfb_ms"):
        xs = [float(x.get(k, 0.0)) for x in lines
              if since <= _ts(x) - x.get("ms", 0) / 1000 < until]
        out[k] = p95(xs)
    return out


def _ts(x: dict[str, Any]) -> float:
    return float(x["ts"])


def fairness_heavy_light() -> None:
    global start
    import tempfile

    audit = os.path.join(tempfile.mkdtemp(prefix="tenants-"), "audit.jsonl")
    f = Fleet({"Audit__Path": audit}, {"heavy": {}, "light": {}})
    alone: list[Result] = []
    both: list[Result] = []
    heavy: list[Result] = []
    spans: dict[str, tuple[float, float]] = {}
    cpu: dict[str, dict[str, float]] = {}

    async def main() -> None:
        global start
        # Each key its own client (its own connections): the heavy key's backlog passes the
        # 400 connections of one pool, which would hold the light key's requests in the
        # client itself, never reaching the hub.
        async with client() as c, client() as lc:
            start = trio.current_time()
            t, meter = time.time(), Cpu({"hub": f.hub.pid, "node": f.node.pid, "bench": os.getpid()})
            await open_loop(lc, f.hub.url, "light", 1.2, 20, alone, stream=True)
            spans["alone"], cpu["alone"] = (t, time.time()), meter.shares()
            start = trio.current_time()
            t, meter = time.time(), Cpu({"hub": f.hub.pid, "node": f.node.pid, "bench": os.getpid()})
            async with trio.open_nursery() as n:
                n.start_soon(open_loop, c, f.hub.url, "heavy", 24.0, 40, heavy)
                await open_loop(lc, f.hub.url, "light", 1.2, 40, both, stream=True)
            spans["both"], cpu["both"] = (t, time.time()), meter.shares()

    try:
        run(main)
    finally:
        f.close()
    ok = [r for r in alone if r.status == 200], [r for r in both if r.status == 200]
    a_ttft, b_ttft = p95([r.ttft for r in ok[0]]), p95([r.ttft for r in ok[1]])
    a_tot, b_tot = p95([r.total for r in ok[0]]), p95([r.total for r in ok[1]])
    hv = [r for r in heavy if r.status == 200]
    print("1. one heavy key at 20x the light key's rate (24/s vs 1.2/s; the fleet serves ~16/s)")
    print(f"   light key p95 time to first token: alone {a_ttft * 1000:.0f} ms, with the heavy "
          f"key {b_ttft * 1000:.0f} ms ({b_ttft / a_ttft:.2f}x)")
    print(f"   light key p95 total: alone {a_tot * 1000:.0f} ms, with the heavy key "
          f"{b_tot * 1000:.0f} ms ({b_tot / a_tot:.2f}x); light answered "
          f"{len(ok[1])}/{len(both)}")
    print(f"   heavy key: {len(hv)}/{len(heavy)} answered, p95 total {p95([r.total for r in hv]):.1f} s"
          " (its own backlog)")
    # Where the light key's first token waited (the hub's audit), and how busy the box was:
    # a queue_ms near 0 beside the heavy key means the rule let it straight in.
    for span in ("alone", "both"):
        b = light_breakdown(audit, *spans[span])
        shares = ", ".join(f"{k} {v:.0%}" for k, v in cpu[span].items())
        print(f"   light key {span:5}: p95 queue {b['queue_ms']:.1f} ms, node wait "
              f"{b['node_wait_ms']:.1f} ms, hub ttfb {b['ttfb_ms']:.1f} ms; CPU of one core: "
              f"{shares}; load {os.getloadavg()[0]:.1f}")


# --- 2. equal keys ------------------------------------------------------------------------

def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def fairness_equal() -> None:
    keys = ("team-a", "team-b", "team-c")
    f = Fleet({}, {k: {} for k in keys})
    out: list[Result] = []

    async def main() -> None:
        async with client() as c:
            async with trio.open_nursery() as n:
                for k in keys:
                    n.start_soon(partial(closed_loop, c, f.hub.url, k, 16, 70.0, out,
                                         stream=True))

    t0 = time.monotonic()
    try:
        run(main)
    finally:
        f.close()
    # When each request got its place: its first byte (the engine's first token follows
    # the grant by a few ms); its cost as fair queueing counts it.
    done = [(r.sent + r.ttft - t0, r.key, r.usage[0] + 2 * r.usage[1]) for r in out
            if r.status == 200]
    biggest = max(c for _, _, c in done)

    def window(s: float) -> dict[str, int]:
        return {k: sum(c for t, kk, c in done if kk == k and s <= t < s + 60) for k in keys}

    # The first second: the first 8 requests to arrive took the free places at once, before
    # anyone queued (work-conserving; the fair share governs only a backlog).
    first = window(0)
    worst_gap, worst_jain = 0.0, 1.0
    for s in range(1, 11):
        per = window(s)
        worst_jain = min(worst_jain, jain(list(per.values())))
        worst_gap = max(worst_gap, max(per.values()) - min(per.values()))
    print("2. three equal keys, 16 outstanding each, 70 s; token service (input + 2 x output)"
          " granted per 60 s window (by first byte), windows starting at 1..10 s")
    print(f"   Jain's index, worst window: {worst_jain:.4f}; largest gap between two keys: "
          f"{worst_gap:.0f} (VTC bound 2 x largest cost = {2 * biggest}); "
          f"{len(done)} answered; the window from 0 s (the places taken before any "
          f"backlog included): gap {max(first.values()) - min(first.values())}")


# --- 3. a token limit -------------------------------------------------------------------------

def token_limit() -> None:
    limit, cap = 6000, 100
    f = Fleet({}, {"metered": {"Tpm": str(limit)}})
    out: list[Result] = []

    async def main() -> None:
        async with client() as c:
            await closed_loop(c, f.hub.url, "metered", 50, 75.0, out, honour_retry=True,
                              max_tokens=cap)

    try:
        run(main)
    finally:
        f.close()
    admitted = sorted((r.sent, r.usage[0] + r.usage[1]) for r in out if r.status == 200)
    refused = [r for r in out if r.status == 429]
    worst = max(sum(n for t, n in admitted if s <= t < s + 60) for s, _ in admitted)
    errors = []
    for r in refused:
        due = r.sent + r.total + r.retry_after  # the 429 received, plus its Retry-After
        nxt = next((t for t, _ in admitted if t >= r.sent + r.total), None)
        if nxt is not None:
            errors.append(nxt - due)
    print(f"3. Tpm={limit}, 50 concurrent clients honouring Retry-After, max_tokens {cap}, 75 s")
    print(f"   most tokens (engine usage) in any 60 s window of admissions: {worst} "
          f"(limit + one cap = {limit + cap}); {len(admitted)} answered, {len(refused)} 429s")
    if errors:
        print(f"   next admission minus (429 + Retry-After): median {statistics.median(errors):+.2f} s,"
              f" min {min(errors):+.2f} s, max {max(errors):+.2f} s")


# --- 4. preemption ----------------------------------------------------------------------------

def preemption() -> None:
    f = Fleet({"Priority__Enabled": "true", "Priority__Preempt": "true",
               "Priority__ReserveSlots": "0"},
              {"batch": {"Priority": "background"}, "ops": {"Priority": "essential"}})
    started: list[Result] = []
    waiting: list[Result] = []
    ess: list[Result] = []

    async def main() -> None:
        async with client() as c:
            async with trio.open_nursery() as n:
                for _ in range(PARALLEL // 2):  # stream for ~3 s from the start
                    n.start_soon(lambda: _append(started, chat(c, f.hub.url, "batch",
                                                               max_tokens=300, stream=True)))
                await trio.sleep(0.3)
                for i in range(PARALLEL // 2):
                    # ~40 kB each, unique from its first word (the sim's prefix cache would
                    # skip a repeated one): ~10k tokens, ~2.5 s of prefill, no first byte
                    big = f"request {i} " + "lorem " * 7000
                    n.start_soon(lambda big=big: _append(waiting, chat(
                        c, f.hub.url, "batch", max_tokens=5, content=big, stream=True)))
                await trio.sleep(0.3)
                await _append(ess, chat(c, f.hub.url, "ops", max_tokens=5, stream=True))

    try:
        run(main)
    finally:
        f.close()
    cut = [r for r in started if r.status != 200 or "[DONE]" not in r.body or '"error"' in r.body]
    pre = [r for r in waiting if r.status == 503 and "preempted" in r.body]
    print("4. preemption: 4 background streams started, 4 background waiting for their first "
          "byte, on 8 places")
    print(f"   essential time to first token: {ess[0].ttft * 1000:.0f} ms (status {ess[0].status});"
          f" background preempted: {len(pre)}; started streams cut: {len(cut)}")


async def _append(out: list[Result], aw: Awaitable[Result]) -> None:
    out.append(await aw)


# --- the hub's cost ---------------------------------------------------------------------------

def cost() -> None:
    f = Fleet({}, {"limited": {"Rpm": "1000000", "Tpm": "1000000000"}, "free": {}})
    per: dict[str, float] = {}

    async def main() -> None:
        async with client() as c:
            for key in ("free", "limited", "free", "limited"):
                out: list[Result] = []
                t0 = cpu_seconds(f.hub.popen.pid)
                await closed_loop(c, f.hub.url, key, 8, 8.0, out, max_tokens=1)
                n = sum(r.status == 200 for r in out)
                per.setdefault(key, math.inf)
                per[key] = min(per[key], (cpu_seconds(f.hub.popen.pid) - t0) / n * 1e6)

    try:
        run(main)
    finally:
        f.close()
    print(f"5. hub CPU per request (best of two 8 s runs, 8 concurrent, 1-token answers): "
          f"no limits {per['free']:.0f} us, Rpm+Tpm limits {per['limited']:.0f} us "
          f"({per['limited'] / per['free'] - 1:+.1%})")


# --- 6. a full fleet: a place kept back for the light key (issue 27) ------------------------

def full_fleet() -> None:
    """Two nodes of two places each (Node__MaxConcurrency = Node__ModelSlots = Sim__Parallel
    = 2): the heavy key keeps 16 long streams going (200 tokens, ~2 s each), the light key
    sends short chats (5 tokens) one at a time, 0.5 s apart. Light alone, then both; then
    the heavy key alone, for its throughput."""
    procs = Procs()
    env = {"Auth__NodeToken": TOKEN, "Audit__Path": "/dev/null", "Queue__MaxDepth": "5000",
           "Queue__MaxWaitSeconds": "300"}
    for i, name in enumerate(("heavy", "light")):
        env.update({f"Auth__Clients__{i}__Name": name, f"Auth__Clients__{i}__Key": name})
    hub = procs.hub(env, metrics=False)
    try:
        for n in ("gpu-a", "gpu-b"):
            node = procs.node(n, {
                "Hub__Url": hub.url, "Auth__NodeToken": TOKEN, "Node__AnnounceSeconds": "1",
                "Sim__Models__0__Name": MODEL, "Sim__TokensPerSecond": "100",
                "Sim__Parallel": "2", "Node__MaxConcurrency": "2", "Node__ModelSlots": "2"})
            httpx.post(node.url + f"/node/v1/models/{MODEL}/load", timeout=30,
                       headers={"authorization": f"Bearer {TOKEN}"}).raise_for_status()
        wait_until(lambda: any(m["name"] == MODEL and len(m["nodes"]) == 2 for m in httpx.get(
            hub.url + "/api/status", timeout=5).json()["models"]), what="ready on two nodes")
        alone: list[Result] = []
        both: list[Result] = []
        heavy_both: list[Result] = []
        heavy_alone: list[Result] = []
        seconds = 30.0

        async def light(out: list[Result]) -> None:
            end = trio.current_time() + seconds
            async with client() as c:
                while trio.current_time() < end:
                    out.append(await chat(c, hub.url, "light", max_tokens=5, stream=True))
                    await trio.sleep(0.5)

        async def main() -> None:
            await light(alone)
            async with client() as c, trio.open_nursery() as n:
                n.start_soon(partial(closed_loop, c, hub.url, "heavy", 16, seconds, heavy_both,
                                     max_tokens=200, stream=True))
                await trio.sleep(2)
                await light(both)
            async with client() as c:
                # the light key quiet past share.ACTIVE_SECONDS before the heavy key runs alone
                await trio.sleep(11)
                await closed_loop(c, hub.url, "heavy", 16, seconds, heavy_alone,
                                  max_tokens=200, stream=True)

        run(main)
    finally:
        procs.close()

    def tps(rs: list[Result]) -> float:
        ok = [r for r in rs if r.status == 200]
        span = max(r.sent + r.total for r in ok) - min(r.sent for r in ok)
        return sum(r.usage[1] for r in ok) / span

    a = p95([r.ttft for r in alone if r.status == 200])
    b = p95([r.ttft for r in both if r.status == 200])
    print("6. full fleet, 2 nodes x 2 places: heavy key 16 long streams, light key short chats"
          " one at a time")
    print(f"   light key p95 time to first token: alone {a * 1000:.0f} ms, beside the heavy key "
          f"{b * 1000:.0f} ms ({b / a:.2f}x); {len(both)} light requests")
    print(f"   heavy key output tokens/s: alone {tps(heavy_alone):.1f}, beside the light key "
          f"{tps(heavy_both):.1f} ({tps(heavy_both) / tps(heavy_alone) - 1:+.1%})")


if __name__ == "__main__":
    parts = {"1": fairness_heavy_light, "2": fairness_equal, "3": token_limit,
             "4": preemption, "5": cost, "6": full_fleet}
    for name in sys.argv[1:] or list(parts):
        parts[name]()
