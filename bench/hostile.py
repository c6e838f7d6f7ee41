"""Benchmark: what hostile clients cost the hub (issue 10), against real processes.

A hub (keys required, default limits except where named) and one sim node. Measured:

1. /metrics bytes before and after 2,000 requests for unknown model names (target: < 1 KB).
2. 900 clients that send half a request head and stop: the hub's open fds at the peak
   (bound: Hub__MaxConnections), and how long an ordinary request then takes.
3. A body sent at one byte a second: when the hub cuts it (Hub__BodyReadSeconds).
4. Ten concurrent 30 MB bodies: the hub's RSS before, at the peak and after.

Run: .venv/bin/python bench/hostile.py [--max-connections 256] [--body-seconds 5]
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "harness"))

from procfs import fd_count as fds  # noqa: E402
from procfs import rss_kb  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

KEY, TOKEN = "bench-key", "bench-token"
MiB = 1024 * 1024


def rss_mb(pid: int) -> float:
    return rss_kb(pid) / 1024


def chat(url: str, model: str = "sim-small", timeout: float = 120) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      timeout=timeout,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2})


class Peak:
    """`read()` sampled every `every` seconds in a thread of its own until `stop` is set."""

    def __init__(self, read, every: float) -> None:
        self.seen = [read()]
        self.stop = threading.Event()

        def sample() -> None:
            while not self.stop.wait(every):
                self.seen.append(read())

        threading.Thread(target=sample, daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-connections", type=int, default=256)
    ap.add_argument("--body-seconds", type=float, default=5)
    args = ap.parse_args()
    procs = Procs()
    try:
        hub = procs.hub({"Auth__NodeToken": TOKEN, "Auth__RequireKeys": "true",
                         "Auth__Clients__0__Name": "bench",
                         "Auth__Clients__0__Key": KEY,
                         "Hub__MaxConnections": str(args.max_connections),
                         "Hub__BodyReadSeconds": str(args.body_seconds),
                         "Hub__HeaderReadSeconds": "10"})
        procs.node("gpu-a", {"Hub__Url": hub.url, "Auth__NodeToken": TOKEN})
        wait_until(lambda: chat(hub.url, timeout=10).status_code == 200, timeout=30,
                   what="a first answer")
        host, port = hub.url.split("//")[1].rsplit(":", 1)
        port = int(port)
        pid = hub.pid
        metrics = hub.urls["metrics"] + "/metrics"

        before = len(httpx.get(metrics).content)
        with httpx.Client(base_url=hub.url, headers={"authorization": f"Bearer {KEY}"}) as c:
            for i in range(2000):
                c.post("/v1/chat/completions", json={"model": f"unknown-{i}", "messages": []})
        after = len(httpx.get(metrics).content)
        print(
            f"1. /metrics: {before} bytes before, {after} after 2,000 unknown names "
            f"(+{after - before} bytes)")

        base = fds(pid)
        socks = []
        for _ in range(900):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, port))
            socks.append(s)
        time.sleep(0.5)
        for s in socks:
            try:
                s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            except OSError:
                pass
        fds_peak = Peak(lambda: fds(pid), 0.1)
        t0 = time.monotonic()
        code = chat(hub.url).status_code
        took = time.monotonic() - t0
        fds_peak.stop.set()
        for s in socks:
            s.close()
        print(
            f"2. 900 slow heads: hub fds {base} idle, peak {max(fds_peak.seen)} "
            f"(Hub__MaxConnections={args.max_connections});"
              f" an ordinary request answered {code} in {took:.1f} s")

        s = socket.create_connection((host, port))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                  + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
        t0 = time.monotonic()
        got = b""
        s.settimeout(1.0)
        while True:
            try:
                s.send(b" ")
            except OSError:
                break
            try:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            except TimeoutError:
                pass
            except OSError:
                break
        s.close()
        print(
            f"3. one byte a second: cut after {time.monotonic() - t0:.1f} s with "
            f"{got.split(b' ', 2)[1].decode() if got else 'no answer'}"
              f" (Hub__BodyReadSeconds={args.body_seconds:g})")

        idle = rss_mb(pid)
        rss_peak = Peak(lambda: rss_mb(pid), 0.05)
        body = b'{"model": "sim-small", "messages": [], "pad": "' + b"x" * (30 * MiB) + b'"}'

        def big() -> None:
            try:
                httpx.post(hub.url + "/v1/chat/completions", content=body, timeout=60,
                           headers={"authorization": f"Bearer {KEY}",
                                    "content-type": "application/json"})
            except httpx.HTTPError:
                pass

        threads = [threading.Thread(target=big) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)
        rss_peak.stop.set()
        print(f"4. ten 30 MB bodies at once: hub RSS {idle:.0f} MB idle, peak "
              f"{max(rss_peak.seen):.0f} MB, "
              f"{rss_mb(pid):.0f} MB 2 s after")
    finally:
        procs.close()


if __name__ == "__main__":
    main()
