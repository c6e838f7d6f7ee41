"""Tracing's cost on two source trees side by side: each tree's hub with tracing off and
on (sampler always_on, OTLP/HTTP to a receiver in this process), one node and sim in front.

Run: .venv/bin/python bench/tracing_ab.py TREE_A,TREE_B [REQUESTS] [ROUNDS] [CONC]

TREE_A and TREE_B are checkouts of this repository (`git archive COMMIT | tar -x -C DIR`);
the node and sim come from the first. Short chats (max_tokens 8), REQUESTS (800) a round
at concurrency CONC (8), ROUNDS (8) rounds going through the four hubs in turn; prints
each hub's CPU per request (utime + stime from /proc, the export thread included) per
round and the median, and on/off per tree. On a shared box the rounds swing; the trees'
on/off, measured in the same minutes, is the figure.
"""

from __future__ import annotations

import os
import statistics
import sys

import httpx
import trio

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from overhead import fronted, run_load  # noqa: E402
from procfs import cpu_seconds  # noqa: E402
from procs import Procs, wait_until  # noqa: E402
from tracing_cost import Receiver  # noqa: E402

CHAT = "/v1/chat/completions"
SHORT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def main() -> None:
    trees = sys.argv[1].split(",")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 800
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    conc = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    receiver = Receiver()
    endpoint = receiver.serve()
    procs = Procs()
    try:
        _, node = fronted(procs, "n", "ollama", tree=trees[0])
        common = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Audit__Path": os.devnull,
                  "Nodes__0__Name": "n", "Nodes__0__Url": node.url}
        on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_SAMPLER": "always_on"}
        hubs = {}
        for t in trees:
            hubs[(t, "off")] = procs.start("hub", common, tree=t)
            hubs[(t, "on")] = procs.start("hub", {**common, **on}, tree=t)
        for h in hubs.values():
            wait_until(lambda h=h: httpx.post(h.url + CHAT, json=SHORT,
                                              timeout=60).status_code == 200,
                       60, "a 200 from the hub", interval=0.2)
            trio.run(run_load, h.url + CHAT, SHORT, 200, conc, False)
        per: dict[tuple[str, str], list[float]] = {k: [] for k in hubs}
        for _ in range(rounds):
            for k, h in hubs.items():
                before = cpu_seconds(h.pid)
                trio.run(run_load, h.url + CHAT, SHORT, n, conc, False)
                per[k].append((cpu_seconds(h.pid) - before) / n * 1e6)
        print(f"hub us CPU per short chat, {rounds} rounds x {n} at c={conc}, interleaved")
        for t in trees:
            off, got = statistics.median(per[(t, "off")]), statistics.median(per[(t, "on")])
            print(f"{t}: off {off:.0f} {[round(x) for x in per[(t, 'off')]]}  "
                  f"on {got:.0f} {[round(x) for x in per[(t, 'on')]]}  on/off {got / off:.2f}")
    finally:
        procs.close()
        receiver.shutdown()


if __name__ == "__main__":
    main()
