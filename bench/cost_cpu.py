"""Hub CPU per request with cost routing, side by side in one run (issue 27 item 5).

Run: .venv/bin/python bench/cost_cpu.py [--before TREE] [--rounds 8] [--per-round 100]

One sim engine (no artificial delay, 64 parallel); per variant a hub in front of two
`Engine__Kind=openai` nodes of that engine (two: the cost pick ranks nodes; a fixed
upstream: no hub unloads the model the others use), its own nodes (a node watched by
several hubs works as in HA). Variants, their rounds interleaved
so every variant sees the same minutes of a shared box:

- `off`: this tree, `Router__Affinity=off` (no key, no cost pick: admission's spread);
- `on`: this tree as shipped (affinity keys, cost routing, home waits, the share check);
- `before` (with `--before TREE`, a checkout of the commit before issue 27's first,
  e.g. `git worktree add /tmp/before 184f97d^`): that tree's hub (affinity's rendezvous,
  no cost), this tree's nodes and engine.

Each round sends, per variant, `--per-round` streamed chats at concurrency 1 and again at
8, each carrying a ~2k-token prompt of one of 24 conversations (so it has a key: the
prefix chain is made and the cost pick runs) and max_tokens 8; the hub's CPU (utime +
stime from /proc) over the round, per request. Prints per variant and concurrency the hub
ms per request and the ratio to `off` (and to `before`).

A request still running after STALL_DUMP_SECONDS has every process's trio tasks written
(bench/taskdump.py, through gdb) with `ss -tnpi` to a folder the run names, before the
request is given up at STALL_SECONDS: where the hub, its nodes and the sim wait then.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
sys.path.insert(0, os.path.dirname(__file__))
from overhead import run_load  # noqa: E402
from procfs import cpu_seconds  # noqa: E402
from procs import Proc, Procs  # noqa: E402
from taskdump import dump  # noqa: E402

CHAT = "/v1/chat/completions"
MODEL = "sim-small"
HERE = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def bodies(n: int = 24) -> list[dict]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        ctx = " ".join(rng.choice(WORDS) for _ in range(1400))  # ~8 KB, ~2k tokens
        out.append({"model": MODEL, "max_tokens": 8, "stream": True,
                    "messages": [{"role": "system", "content": ctx},
                                 {"role": "user", "content": "next?"}]})
    return out


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where it waits
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="", help="a checkout of the tree before issue 27")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--per-round", type=int, default=100)
    args = ap.parse_args()
    variants = {"off": (HERE, {"Router__Affinity": "off"}), "on": (HERE, {})}
    if args.before:
        # An older tree may read an empty Store__Path as its default (/var/lib/appliance):
        # a store of its own in a temporary folder instead.
        store = os.path.join(tempfile.mkdtemp(prefix="cost-cpu-"), "store.db")
        variants["before"] = (os.path.abspath(args.before), {"Store__Path": store})
    chats = bodies()
    procs = PROCS
    try:
        sim = procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": "0",
                                  "Sim__Parallel": "64"}, tree=HERE)
        hubs: dict[str, Proc] = {}
        for name, (tree, extra) in variants.items():
            env = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                   "Audit__Path": os.devnull, **extra}
            for i in range(2):
                node = procs.start("node", {
                    "Node__Name": f"{name}-{i}", "Node__Listen": "127.0.0.1:0",
                    "Metrics__Listen": "", "Engine__Kind": "openai", "Engine__Url": sim.url + "/v1",
                    "Node__ModelSlots": "32"}, tree=HERE)
                env.update({f"Nodes__{i}__Name": f"{name}-{i}", f"Nodes__{i}__Url": node.url})
            hubs[name] = procs.start("hub", env, tree=tree)
        for hub in hubs.values():  # the model loaded on both nodes, the paths warm
            deadline = time.monotonic() + 90
            while True:
                st = httpx.get(hub.url + "/api/status", timeout=10).json()
                m = next((m for m in st["models"] if m["name"] == MODEL), None)
                if m is not None and len(m.get("nodes", [])) == 2:
                    break
                httpx.post(hub.url + CHAT, json=dict(chats[0], stream=False), timeout=60)
                assert time.monotonic() < deadline, "the model never became ready on both nodes"
                time.sleep(0.5)
            for body in chats:
                trio.run(run_load, hub.url + CHAT, body, 2, 1, True)
        print("ready; rounds:", end="", flush=True)
        cpu: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            print(f" {r + 1}", end="", flush=True)
            for conc in (1, 8):
                for name, hub in hubs.items():
                    print(f"{name}/{conc}", end=" ", flush=True)
                    before = cpu_seconds(hub.pid)
                    trio.run(spread, hub.url, chats, args.per_round, conc)
                    cpu.setdefault((name, conc), []).append(
                        (cpu_seconds(hub.pid) - before) / args.per_round)
                    print(f"{cpu[(name, conc)][-1] * 1e3:.3f}ms", end=" ", flush=True)
        print()
        print(f"{args.rounds} rounds x {args.per_round} streamed chats (max_tokens 8, a ~2k-token "
              f"prompt of 24 conversations), interleaved; hub CPU ms per request, "
              f"median of rounds (mean)")
        for conc in (1, 8):
            base = statistics.median(cpu[("off", conc)])
            for name in hubs:
                xs = cpu[(name, conc)]
                med = statistics.median(xs)
                print(f"  concurrency {conc}  {name:6}  {med * 1e3:6.3f} ms "
                      f"({statistics.mean(xs) * 1e3:6.3f})  x{med / base:5.3f} of off")
        if STALLED:
            print(f"  {len(STALLED)} requests given up after {STALL_SECONDS:g} s: "
                  + ", ".join(sorted(set(STALLED))))
        for folder in DUMPS:
            print(f"  a stall's trio tasks: {folder}")
    finally:
        procs.close()


async def spread(url: str, chats: list[dict], n: int, conc: int) -> None:
    """`n` streamed chats, `conc` at once, each worker through the conversations in turn."""
    per = n // conc
    async with trio.open_nursery() as outer:
        outer.start_soon(_watch_stalls, url)
        async with trio.open_nursery() as nursery:
            for i in range(conc):
                nursery.start_soon(_worker, url, chats, i, per)
        outer.cancel_scope.cancel()


STALLED: list[str] = []  # requests given up after STALL_SECONDS (said at the end)
STALL_SECONDS = 10.0
STALL_DUMP_SECONDS = 8.0  # ... and dumped (taskdump) after this long, at most STALL_DUMPS a run
STALL_DUMPS = 2
PROCS = Procs()
RUNNING: dict[int, float] = {}  # worker -> when its request began (time.monotonic)
DUMPS: list[str] = []


async def _watch_stalls(url: str) -> None:
    """Once a request has run STALL_DUMP_SECONDS: every process's trio tasks, and sockets."""
    while len(DUMPS) < STALL_DUMPS:
        await trio.sleep(1)
        now = time.monotonic()
        if not any(now - t > STALL_DUMP_SECONDS for t in RUNNING.values()):
            continue
        folder = tempfile.mkdtemp(prefix="cost-cpu-stall-")
        DUMPS.append(folder)
        with open(os.path.join(folder, "ss.txt"), "w") as f:
            subprocess.run(["ss", "-tnpi"], stdout=f, stderr=subprocess.STDOUT, check=False)
        notes = [f"a request to {url} ran over {STALL_DUMP_SECONDS:g} s"]
        for p in PROCS.all:
            why = dump(p.pid, os.path.join(folder, f"{p.role}-{p.pid}.txt"))
            notes.append(f"{p.role} {p.pid} {p.url}: {why or 'dumped'}")
        with open(os.path.join(folder, "README"), "w") as f:
            f.write("\n".join(notes) + "\n")
        print(f"\n  stalled: trio tasks of every process in {folder}", flush=True)


async def _worker(url: str, chats: list[dict], i: int, n: int) -> None:
    """A stalled request (one in a few hundred never ends through hub -> node -> sim on
    this box) is given up, its client abandoned (its pool may hold the stalled stream)."""
    c = httpx.AsyncClient(timeout=60)
    for j in range(n):
        body = chats[(i * 7 + j) % len(chats)]
        RUNNING[i] = time.monotonic()
        with trio.move_on_after(STALL_SECONDS) as cs:
            async with c.stream("POST", url + CHAT, json=body) as r:
                assert r.status_code == 200, r.status_code
                async for _ in r.aiter_bytes():
                    pass
        RUNNING.pop(i, None)
        if cs.cancelled_caught:
            STALLED.append(url)
            c = httpx.AsyncClient(timeout=60)
    with trio.move_on_after(1):
        await c.aclose()


if __name__ == "__main__":
    main()
