"""Two source trees side by side, interleaved in one run, so both see the same load.

Run: .venv/bin/python bench/ab_trees.py TREE_A TREE_B [ROUNDS] [--stream] [--rate N]

TREE_A and TREE_B are checkouts of this repository (e.g. `git worktree add /tmp/a main~3`,
or `git archive COMMIT | tar -x -C /tmp/a`). Starts one sim engine and, per tree,
a node and a hub in front of it (the processes import that tree's `appliance`), then for
ROUNDS rounds (default 10) sends 100 short chats at concurrency 1 to the engine, each
node and each hub, alternating A and B, and prints p50, the added p50 and the CPU per
request of each process, read from /proc. `--stream`: the chats are streamed (else each is
one answer, which the hub assembles from the engine's stream); `--rate`: the sim's tokens
per second (default 0: at once, the whole stream in one read; a real engine's come one
per read, each a wake-up on every hop that relays them). On a box with other work
the figures swing from run to run; the difference between A and B, measured in the same
minutes, does not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
sys.path.insert(0, os.path.dirname(__file__))
from overhead import run_load  # noqa: E402
from procfs import cpu_seconds  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

PER_ROUND = 100
SHORT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
CHAT = "/v1/chat/completions"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tree_a")
    ap.add_argument("tree_b")
    ap.add_argument("rounds", nargs="?", type=int, default=10)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--rate", type=float, default=0.0)
    args = ap.parse_args()
    trees = {"A": args.tree_a, "B": args.tree_b}
    rounds, stream = args.rounds, args.stream
    body = {**SHORT, "stream": True} if stream else SHORT
    procs = Procs()
    try:
        sim = procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": str(args.rate),
                                  "Sim__Parallel": "64"}, tree=trees["A"])
        stacks = {}
        for name, tree in trees.items():
            node = procs.start("node", {"Node__Name": "n" + name, "Node__Listen": "127.0.0.1:0",
                                        "Metrics__Listen": "", "Engine__Kind": "ollama",
                                        "Engine__Url": sim.url, "Node__ModelSlots": "64"},
                               tree=tree)
            hub = procs.start("hub", {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                                      "Audit__Path": os.devnull, "Nodes__0__Name": "n" + name,
                                      "Nodes__0__Url": node.url}, tree=tree)
            stacks[name] = (node, hub)
        for node, hub in stacks.values():  # the model loaded, both paths warm
            wait_until(lambda hub=hub: httpx.post(hub.url + CHAT, json=SHORT,
                                                  timeout=60).status_code == 200,
                       60, "a 200 from the hub", interval=0.2)
            for url in (hub.url, node.url):
                trio.run(run_load, url + CHAT, body, PER_ROUND, 1, stream)
        res = {(n, t): {"lat": [], "hub": 0.0, "node": 0.0, "eng": 0.0, "n": 0}
               for n in stacks for t in ("direct", "node", "hub")}
        for _ in range(rounds):
            for name, (node, hub) in stacks.items():
                for t, url in (("direct", sim.url), ("node", node.url), ("hub", hub.url)):
                    who = (("hub", hub), ("node", node), ("eng", sim))
                    before = {k: cpu_seconds(p.pid) for k, p in who}
                    lat, _, _ = trio.run(run_load, url + CHAT, body, PER_ROUND, 1, stream)
                    after = {k: cpu_seconds(p.pid) for k, p in who}
                    x = res[(name, t)]
                    x["lat"] += lat
                    x["n"] += PER_ROUND
                    for k in ("hub", "node", "eng"):
                        x[k] += after[k] - before[k]
        print(f"{rounds} rounds x {PER_ROUND} short {'streamed ' if stream else ''}requests "
              f"(sim {args.rate:g} tokens/s) "
              "at concurrency 1, interleaved; "
              f"A={trees['A']} B={trees['B']}")
        for name in stacks:
            base = statistics.median(res[(name, "direct")]["lat"])
            for t in ("direct", "node", "hub"):
                x = res[(name, t)]
                p50 = statistics.median(x["lat"])
                print(f"{name} {t:<7} p50 {p50 * 1e3:6.2f} ms  +{(p50 - base) * 1e3:5.2f} ms"
                      f"  CPU ms/req: hub {x['hub'] / x['n'] * 1e3:6.3f}"
                      f"  node {x['node'] / x['n'] * 1e3:6.3f}  eng {x['eng'] / x['n'] * 1e3:6.3f}")
    finally:
        procs.close()


if __name__ == "__main__":
    main()
