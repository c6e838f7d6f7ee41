"""What tracing costs the hub: CPU per request with OpenTelemetry on and off, in one run.

Run: .venv/bin/python bench/overhead.py --tracing [--requests N] [--stream-requests N]
     (or this file directly, with the same options)

Starts `appliance sim`, one `appliance node` fronting it, and two hubs knowing that node:
one without OTEL_* (tracing off: nothing of OpenTelemetry imported) and one with
`OTEL_EXPORTER_OTLP_ENDPOINT` at an OTLP/HTTP receiver in this process (it answers 200
and counts the bytes, decoding nothing) and `OTEL_TRACES_SAMPLER=always_on` (every request
a trace: the sampler at 1.0), and a third with the endpoint but `always_off` (tracing
set up, no request sampled: what the import and an unsampled span cost). The same requests go to the hubs in alternating rounds --
a short chat and a streamed one, at concurrency 1 and 8 -- and each hub's CPU (utime +
stime from /proc, export thread included) is read around each round. Prints the median
per round of hub ms CPU per request, off and on, and their ratio; the node does the same
work either way (it does not trace here). Last, each hub's CPU over all rounds split by
thread (/proc/PID/task): the trio thread's and the rest's (the export thread, when on).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import trio

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from overhead import fronted, run_load  # noqa: E402
from procfs import cpu_seconds, loop_and_rest, thread_cpu  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

ROUNDS = 5


class Receiver(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.posts = 0
        self.bytes = 0
        super().__init__(("127.0.0.1", 0), _Handler)

    def serve(self) -> str:
        """Serving in a thread of its own: its OTLP/HTTP endpoint."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def log_message(self, *args):
        pass

    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        self.server.posts += 1
        self.server.bytes += n
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tracing", action="store_true", help="(accepted: overhead.py's switch)")
    ap.add_argument("--requests", type=int, default=400, help="short chats per round")
    ap.add_argument("--stream-requests", type=int, default=64,
                    help="streamed chats (200 chunks) per round")
    args, _ = ap.parse_known_args(argv)
    receiver = Receiver()
    endpoint = receiver.serve()
    procs = Procs()
    try:
        _, node = fronted(procs, "bench", "ollama", node={"Node__ProbeSeconds": "0"})
        common = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Audit__Path": os.devnull,
                  "Nodes__0__Name": "bench", "Nodes__0__Url": node.url}
        hubs = {"off": procs.start("hub", common, wait=("hub",)),
                "on": procs.start("hub", {**common, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                                          "OTEL_TRACES_SAMPLER": "always_on"}, wait=("hub",)),
                "unsampled": procs.start("hub", {**common,
                                                 "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
                                                 "OTEL_TRACES_SAMPLER": "always_off"},
                                         wait=("hub",))}
        chat = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}]}
        for h in hubs.values():
            wait_until(lambda h=h: httpx.post(h.url + "/v1/chat/completions", json=chat,
                                              timeout=60).status_code == 200, 60, "hub warm")
        split0 = {name: thread_cpu(h.pid) for name, h in hubs.items()}
        sent = 0
        cases = (("short", {**chat, "max_tokens": 8}, args.requests, False),
                 ("stream200", {**chat, "max_tokens": 200, "stream": True},
                  args.stream_requests, True))
        print(f"hub ms CPU per request, median of {ROUNDS} alternating rounds "
              "(tracing on: sampler always_on, OTLP/HTTP to a local receiver)")
        print(f"{'request':<10}{'conc':>5}{'off':>9}{'on':>9}{'on/off':>8}{'+us/req':>9}"
              f"{'unsampled':>11}{'+us/req':>9}")
        for kind, body, n, stream in cases:
            for conc in (1, 8):
                per: dict[str, list[float]] = {name: [] for name in hubs}
                for h in hubs.values():  # warm-up
                    trio.run(run_load, h.url + "/v1/chat/completions", body, max(conc, n // 10),
                             conc, stream)
                sent += n * ROUNDS + max(conc, n // 10)
                for _ in range(ROUNDS):
                    for name, h in hubs.items():
                        before = cpu_seconds(h.pid)
                        trio.run(run_load, h.url + "/v1/chat/completions", body, n, conc, stream)
                        per[name].append((cpu_seconds(h.pid) - before) / n)
                off, on = statistics.median(per["off"]), statistics.median(per["on"])
                un = statistics.median(per["unsampled"])
                print(f"{kind:<10}{conc:>5}{off * 1e3:>9.3f}{on * 1e3:>9.3f}{on / off:>8.2f}"
                      f"{(on - off) * 1e6:>9.0f}{un * 1e3:>11.3f}{(un - off) * 1e6:>9.0f}")
        wait_until(lambda: receiver.posts > 0, 10, "spans received")
        print("all rounds, by thread (us per request): trio thread / other threads")
        for name, h in hubs.items():
            loop, rest = loop_and_rest(h.pid, split0[name])
            print(f"  {name:<10}{loop / sent * 1e6:8.0f} /{rest / sent * 1e6:6.0f}")
        dropped = httpx.get(hubs["on"].url + "/metrics", timeout=10).text
        line = next((x for x in dropped.splitlines()
                     if x.startswith("appliance_spans_dropped_total")), "(none)")
        print(f"receiver: {receiver.posts} OTLP requests, {receiver.bytes / 1e6:.1f} MB; {line}")
    finally:
        procs.close()
        receiver.shutdown()


if __name__ == "__main__":
    main()
