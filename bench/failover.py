"""Failover of the hubs: time to a new leader, and requests lost, over several kill -9s.

A real etcd (Debian's etcd-server), two hubs (`Cluster__LeaseSeconds`, default 3 here)
and two sim nodes with one always-on model ready on both. Each round: a client thread
sends requests for the ready model back to back to the hub that will survive; the leader
is killed with SIGKILL; we time until the survivor's /api/status says it leads (polled
every 20 ms), keep sending for another second, then restart the killed hub as a follower
for the next round. Requests lost = answers that were not 200 (must be 0: routing to ready
replicas never waits for a leader).

    .venv/bin/python bench/failover.py --kills 5 --lease 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # etcd_proc's tests.harness
from etcd_proc import EtcdProc  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench"
SIM = {"Sim__Models__0__Name": "ready-m", "Sim__Models__0__SizeMb": "100",
       "Sim__TokensPerSecond": "0",
       "Node__MemoryMb": "8000", "Auth__NodeToken": TOKEN}


def cluster(hub) -> dict:
    try:
        return httpx.get(hub.url + "/api/status", timeout=2).json().get("cluster", {})
    except httpx.HTTPError:
        return {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--lease", type=int, default=3)
    args = ap.parse_args()
    procs, tmp = Procs(), tempfile.mkdtemp(prefix="failover-")
    etcd = EtcdProc(os.path.join(tmp, "etcd"))
    etcd.start()
    env = {"Cluster__Etcd": etcd.url, "Cluster__LeaseSeconds": str(args.lease),
           "Auth__NodeToken": TOKEN,
           "Models__0__Name": "ready-m", "Models__0__Replicas": "2"}
    hubs: dict[str, object] = {}
    try:
        def start_hub(name: str) -> None:
            hubs[name] = procs.hub({"Hub__Name": name, **env})

        start_hub("hub-a")
        start_hub("hub-b")
        for n in ("n1", "n2"):
            procs.node(n, {"Hub__Url": ",".join(h.url for h in hubs.values()), **SIM})
        for h in hubs.values():
            wait_until(lambda h=h: any(m["name"] == "ready-m" and m["ready"] == 2 for m in
                                       httpx.get(h.url + "/api/status",
                                                 timeout=5).json()["models"]), timeout=60)
        took, sent_all, lost_all = [], 0, 0
        for k in range(args.kills):
            leader = wait_until(lambda: next((n for n, h in hubs.items()
                                              if cluster(h).get("leading")), None),
                                timeout=30, what="a leader")
            survivor = next(n for n in hubs if n != leader)
            stop, sent, lost = threading.Event(), [0], []

            def hammer(url=hubs[survivor].url):
                with httpx.Client(timeout=20) as c:
                    while not stop.is_set():
                        try:
                            r = c.post(url + "/v1/chat/completions",
                                       json={"model": "ready-m", "messages": [{"role": "user",
                                                                               "content": "hi"}]})
                            if r.status_code != 200:
                                lost.append(r.status_code)
                        except httpx.HTTPError as e:
                            lost.append(repr(e))
                        sent[0] += 1

            t = threading.Thread(target=hammer)
            t.start()
            time.sleep(1.0)
            t0 = time.monotonic()
            hubs[leader].signal(signal.SIGKILL)
            wait_until(lambda: cluster(hubs[survivor]).get("leading"), timeout=args.lease + 30,
                       interval=0.02,
                       what="the survivor leads")
            took.append(time.monotonic() - t0)
            time.sleep(1.0)
            stop.set()
            t.join()
            sent_all += sent[0]
            lost_all += len(lost)
            print(f"kill {k + 1}: {leader} killed, {survivor} leads after {took[-1]:.2f} s; "
                  f"{sent[0]} requests to {survivor}, {len(lost)} lost", flush=True)
            start_hub(leader)
            wait_until(lambda: cluster(hubs[leader]).get("leader") == survivor, timeout=30,
                       what="rejoined")
        print(f"\nlease {args.lease} s, {args.kills} kills: time to a new leader "
              f"min {min(took):.2f} / median {statistics.median(took):.2f} / max {max(took):.2f} "
              "s; "
              f"requests for a ready model: {sent_all} sent, {lost_all} lost")
    finally:
        procs.close()
        etcd.close()


if __name__ == "__main__":
    main()
