"""What a request through a hub worker costs: the lease's round trip, at concurrency 1.

Run: .venv/bin/python bench/workers.py [--requests N] [--stream-requests N]

Starts `appliance sim` (no delay), an `appliance node` fronting it and, one after the
other, a hub with `Hub__Workers=1` and one with `Hub__Workers=2`. Sends N short chats (and
streamed ones of 200 chunks) back to back on one kept-alive connection: to the node
directly (the base), to the one-process hub, and to the two-process hub on a connection
its main process accepted and on one its worker accepted (which process accepted a
connection is read off /proc/net/tcp and /proc/PID/fd). Prints p50, p50 added over the
node alone, and the CPU of the whole hub (main + workers, /proc utime+stime) per request
-- the worker row less the main row is what the lease adds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
import procfs  # noqa: E402
from procfs import children  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

SHORT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
STREAM = {"model": "sim-small", "messages": [{"role": "user", "content": "tell"}],
          "max_tokens": 200, "stream": True}


def tree(pid: int) -> list[int]:
    return [pid, *children(pid)]


def cpu(pids: list[int]) -> float:
    return sum(procfs.cpu_seconds(pid) for pid in pids)


def owner(c: httpx.Client, url: str, pids: list[int]) -> int:
    """The pid (of `pids`) that accepted the client's kept connection."""
    return procfs.owner(c, int(url.rsplit(":", 1)[1]), pids, url + "/health")


def client_on(url: str, want: int, pids: list[int]) -> httpx.Client:
    for _ in range(200):
        c = httpx.Client(timeout=60)
        if owner(c, url, pids) == want:
            return c
        c.close()
    raise SystemExit(f"no connection accepted by pid {want} in 200 tries")


# Requests per kept connection here: the servers close one after 1,000 (then the client's
# next connection may go to the other process).
BLOCK = 400


def run(connect, url: str, body: dict, n: int, pids: list[int]) -> tuple[float, list[float]]:
    """(p50 seconds, CPU seconds of each of `pids` per request), on connections `connect()`
    opens (a fresh one per BLOCK requests, outside the measured time)."""
    def one(c: httpx.Client) -> None:
        if body.get("stream"):
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
        else:
            r = c.post(url + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text

    lat: list[float] = []
    used = [0.0] * len(pids)
    while len(lat) < n:
        c = connect()
        try:
            for _ in range(10):
                one(c)
            time.sleep(0.5)  # the connections not taken (the other process's) are closed
            before = [cpu([p]) for p in pids]
            for _ in range(min(BLOCK, n - len(lat))):
                t = time.perf_counter()
                one(c)
                lat.append(time.perf_counter() - t)
            used = [u + cpu([p]) - b for u, p, b in zip(used, pids, before, strict=True)]
        finally:
            c.close()
    return statistics.median(lat), [u / n for u in used]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--stream-requests", type=int, default=60)
    args = ap.parse_args()
    procs = Procs()
    rows = []
    try:
        sim = procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": "0",
                                  "Sim__Parallel": "64"})
        node = procs.start("node", {"Node__Name": "bench", "Node__Listen": "127.0.0.1:0",
                                    "Metrics__Listen": "", "Engine__Kind": "ollama",
                                    "Engine__Url": sim.url, "Node__ModelSlots": "64"})
        base = {}
        for kind, body, n in (("short", SHORT, args.requests),
                              ("stream200", STREAM, args.stream_requests)):
            base[kind] = run(lambda: httpx.Client(timeout=60), node.url, body, n, [node.pid])[0]
            rows.append((kind, "node alone", base[kind], 0.0, []))
        for workers in (1, 2):
            hub = procs.start("hub", {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                                      "Audit__Path": os.devnull, "Hub__Workers": str(workers),
                                      "Nodes__0__Name": "bench", "Nodes__0__Url": node.url},
                              wait=("hub",))
            wait_until(lambda hub=hub: httpx.post(hub.url + "/v1/chat/completions", json=SHORT,
                                                  timeout=60).status_code == 200,
                       60, "the hub serving sim-small", interval=0.2)
            while len(tree(hub.pid)) < workers:
                time.sleep(0.1)
            pids = tree(hub.pid)
            for who in pids:
                label = (f"hub, Hub__Workers={workers}" if workers == 1 else
                         f"hub, Hub__Workers=2, {'main' if who == hub.pid else 'worker'}")
                for kind, body, n in (("short", SHORT, args.requests),
                                      ("stream200", STREAM, args.stream_requests)):
                    p50, per = run(lambda w=who: client_on(hub.url, w, pids), hub.url, body, n,
                                   pids)
                    rows.append((kind, label, p50, p50 - base[kind], per))
            hub.signal(15)
            hub.wait_exit()
    finally:
        procs.close()
    print(f"{'kind':10} {'target (connection accepted by)':42} {'p50 ms':>8} "
          f"{'+p50 ms':>8} {'hub CPU/req ms':>15} {'(main + worker)':>16}")
    for kind, label, p50, added, per in rows:
        split = " + ".join(f"{x * 1e3:.3f}" for x in per) if len(per) > 1 else ""
        print(f"{kind:10} {label:42} {p50 * 1e3:8.3f} {added * 1e3:8.3f} "
              f"{f'{sum(per) * 1e3:15.3f}' if per else '':15} {split:>16}")


if __name__ == "__main__":
    main()
