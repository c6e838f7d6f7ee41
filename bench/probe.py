"""A replica whose generation hangs: how long until it is out of routing, what the requests
meanwhile see, and how long until it is back once it recovers.

A hub and two sim nodes with `sim-small` ready on both (`Node__ProbeSeconds`,
`Node__ProbeTimeoutSeconds` as given). A client thread streams short chats back to back
through the hub all run long. Each round switches `Sim__Models__0__Hang` on for gpu-a (its
env file rewritten, SIGHUP: the model stays loaded, generation stops), times until
/api/status says `replica_unhealthy` (polled every 50 ms), then switches it off and times
until it is `ok` again. Requests: every answer must be a 200 (a stream sent to the hung
replica is cut before its first byte and retried on gpu-b); retries are counted from the
hub's log ("retried on").

    .venv/bin/python bench/probe.py --rounds 3 --probe-seconds 5 --timeout 2
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
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench-probe"
MODEL = "sim-small"


def env_text(hang: bool, every: float, timeout: float) -> str:
    return (f"Sim__Models__0__Name={MODEL}\nSim__Models__0__Hang={'true' if hang else 'false'}\n"
            f"Node__ProbeSeconds={every:g}\nNode__ProbeTimeoutSeconds={timeout:g}\n")


def health(url: str, node: str) -> str:
    for n in httpx.get(url + "/api/status", timeout=10).json()["nodes"]:
        if n["name"] == node:
            return next((m["health"] for m in n["models"] if m["name"] == MODEL), "")
    return ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe-seconds", type=float, default=5.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    procs = Procs()
    tmp = tempfile.mkdtemp(prefix="bench-probe-")
    stop = threading.Event()
    answers: dict[int, int] = {}
    try:
        hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": os.devnull,
                         "Models__0__Name": MODEL}, metrics=False)
        nodes = {}
        for name in ("gpu-a", "gpu-b"):
            path = os.path.join(tmp, f"{name}.env")
            with open(path, "w") as f:
                f.write(env_text(False, args.probe_seconds, args.timeout))
            nodes[name] = (procs.start("node", {
                "Node__Name": name, "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Engine__Kind": "sim", "Hub__Url": hub.url, "Auth__NodeToken": TOKEN,
                "Node__AnnounceSeconds": "1", "Node__HeartbeatSeconds": "0.5",
                "Sim__TokensPerSecond": "200"}, args=["--env-file", path]), path)
            httpx.post(nodes[name][0].url + f"/node/v1/models/{MODEL}/load",
                       headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
        wait_until(lambda: health(hub.url, "gpu-a") == "ok" and health(hub.url, "gpu-b") == "ok",
                   30, "both ready")

        def client() -> None:
            body = {"model": MODEL, "stream": True, "max_tokens": 8,
                    "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(timeout=60) as c:
                while not stop.is_set():
                    with c.stream("POST", hub.url + "/v1/chat/completions", json=body) as r:
                        r.read()
                    answers[r.status_code] = answers.get(r.status_code, 0) + 1

        threading.Thread(target=client, daemon=True).start()
        out_s, back_s = [], []
        for _ in range(args.rounds):
            proc, path = nodes["gpu-a"]
            for hang, to, sink in ((True, "replica_unhealthy", out_s), (False, "ok", back_s)):
                with open(path, "w") as f:
                    f.write(env_text(hang, args.probe_seconds, args.timeout))
                t0 = time.monotonic()
                proc.signal(signal.SIGHUP)
                wait_until(lambda to=to: health(hub.url, "gpu-a") == to, 120, to, interval=0.05)
                sink.append(time.monotonic() - t0)
                time.sleep(1.0)
        stop.set()
        time.sleep(1.0)
        retried = sum("retried on" in line for line in hub.stderr_lines)
        print(f"Node__ProbeSeconds={args.probe_seconds:g}, Node__ProbeTimeoutSeconds="
              f"{args.timeout:g}, {args.rounds} rounds")
        print(f"hang on -> replica_unhealthy: median {statistics.median(out_s):.2f} s, "
              f"max {max(out_s):.2f} s (bound: interval + timeout + a heartbeat = "
              f"{args.probe_seconds + args.timeout + 0.5:g} s, less while streams run)")
        print(f"hang off -> ok again: median {statistics.median(back_s):.2f} s, "
              f"max {max(back_s):.2f} s (bound: one interval {args.probe_seconds:g} s + a probe)")
        print(f"requests: {sum(answers.values())} answered, by status {answers}; "
              f"{retried} retried on the other node before their first byte")
    finally:
        stop.set()
        procs.close()


if __name__ == "__main__":
    main()
