"""What the hub and the node add: the same requests direct, through a node, through hub + node.

Run: .venv/bin/python bench/overhead.py [--requests N] [--stream-requests N] [--ui-polling]
     [--affinity on|off]
     .venv/bin/python bench/overhead.py --floors [--requests N]
     (only the floors: the lean listener plain and TLS, and hypercorn, side by side)
     .venv/bin/python bench/overhead.py --tracing [--requests N] [--stream-requests N]
     (only the hub's CPU per request with OpenTelemetry on and off: bench/tracing_cost.py)

Starts three real processes on loopback -- `appliance sim` (no artificial delay), an
`appliance node` fronting it (Engine__Kind=ollama at the sim's URL) and an `appliance hub`
knowing that node -- then sends, side by side in one run, a short non-streaming chat and a
streamed chat of 200 chunks to each of the three targets at concurrency 1 and 32. Prints
p50/p99 latency, requests per second, the ratios to direct, and the CPU seconds each
process spent per request and per streamed chunk, read from /proc (utime + stime), and
the hub's RSS at idle. With `--ui-polling`, a thread polls the hub the way its page
(/ui/) does for the whole run -- the status, the nodes and the last requests every 2 s,
the history every 6 s -- so the figures include an operator's open page.

The translated rows: a second sim behind an `Engine__Kind=openai` node, so the hub
translates. Through the hub at concurrency 1: OpenAI chat passed through (the base),
Ollama /api/chat passed through to the Ollama-speaking node, Ollama /api/chat translated
onto the OpenAI engine, Anthropic /v1/messages translated onto it -- added time per
request and hub CPU per request and per streamed event, side by side.

The floors (bench/floor_app.py, an app answering two bytes): our listener on plain TCP and
on TLS (one kept-alive connection, the handshake not counted: a TLS listener's CPU per
request beside plain), and hypercorn's -- the numbers behind the HTTP stack decision
(docs/architecture.md).
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from procfs import cpu_seconds  # noqa: E402
from procs import Proc, Procs, wait_until  # noqa: E402

STREAM_CHUNKS = 200


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def fronted(procs: Procs, name: str, kind: str, tree: str | None = None,
            sim: dict[str, str] | None = None,
            node: dict[str, str] | None = None) -> tuple[Proc, Proc]:
    """A sim (no delay, 64 in parallel) and node `name` before it as a `kind` engine (64
    slots), `sim` and `node` added to their settings; from `tree` (Procs.start)."""
    engine = procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": "0",
                                 "Sim__Parallel": "64", **(sim or {})}, tree=tree)
    return engine, procs.start("node", {
        "Node__Name": name, "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
        "Engine__Kind": kind, "Engine__Url": engine.url, "Node__ModelSlots": "64",
        **(node or {})}, tree=tree)


async def run_load(url: str, body: dict, n: int, conc: int, stream: bool,
                   verify: ssl.SSLContext | bool = True) -> tuple[list[float], float, int]:
    lat: list[float] = []
    chunks = 0
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=60, limits=limits, verify=verify) as client:
        todo = iter(range(n))

        async def worker():
            nonlocal chunks
            for _ in todo:
                t = time.perf_counter()
                if stream:
                    async with client.stream("POST", url, json=body) as r:
                        assert r.status_code == 200, r.status_code
                        async for line in r.aiter_lines():
                            # An SSE event's data line, or an NDJSON line.
                            if (line.startswith("data: ")
                                and line != "data: [DONE]") or line.startswith("{"):
                                chunks += 1
                else:
                    r = await client.post(url, json=body)
                    assert r.status_code == 200, (r.status_code, r.text[:200])
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(conc):
                nursery.start_soon(worker)
        wall = time.perf_counter() - t0
    return lat, wall, chunks


# What the page's app.js fetches each poll (every 2 s) and, every third poll, its charts.
PAGE_POLLS = ("/api/status", "/admin/nodes", "/api/requests/recent?limit=50")
PAGE_POLL_SECONDS = 2.0


def poll_like_the_page(url: str, stop: threading.Event, counts: list[int]) -> None:
    with httpx.Client(base_url=url, timeout=10) as c:
        n = 0
        while not stop.wait(PAGE_POLL_SECONDS):
            for path in PAGE_POLLS + (("/api/status/history",) if n % 3 == 0 else ()):
                assert c.get(path).status_code == 200, path
                counts[0] += 1
            n += 1


def page_poll_cpu(url: str, pid: int, rounds: int = 100) -> float:
    """Hub CPU seconds for one round of the page's requests, back to back on an idle hub."""
    with httpx.Client(base_url=url, timeout=10) as c:
        for path in PAGE_POLLS + ("/api/status/history",):
            c.get(path)
        before = cpu_seconds(pid)
        for i in range(rounds):
            for path in PAGE_POLLS + (("/api/status/history",) if i % 3 == 0 else ()):
                c.get(path)
        return (cpu_seconds(pid) - before) / rounds


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def main() -> None:
    if "--tracing" in sys.argv[1:]:
        import tracing_cost  # beside this file (bench/ is on sys.path when run as a script)
        tracing_cost.main(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=400,
                    help="non-streaming requests per target and concurrency")
    ap.add_argument("--stream-requests", type=int, default=64,
                    help="streamed requests per target and concurrency")
    ap.add_argument("--affinity", choices=("on", "off"), default="on",
                    help="the hub's Router__Affinity (issue 23: its cost per request)")
    ap.add_argument("--ui-polling", action="store_true",
                    help="poll the hub as its /ui/ page does, all run long")
    ap.add_argument("--floors", action="store_true",
                    help="only the floors: the lean listener plain and TLS, and hypercorn")
    args = ap.parse_args()
    if args.floors:
        print_floors(all_floors(args.requests))
        return
    procs = Procs()
    stop_polling = threading.Event()
    polls = [0]
    try:
        sim, node = fronted(procs, "bench", "ollama")
        _, node2 = fronted(procs, "bench-oai", "openai", sim={"Sim__Models__0__Name": "sim-oai"})
        hub = procs.start("hub", {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                                  "Audit__Path": os.devnull, "Router__Affinity": args.affinity,
                                  "Nodes__0__Name": "bench", "Nodes__0__Url": node.url,
                                  "Nodes__1__Name": "bench-oai", "Nodes__1__Url": node2.url},
                          wait=("hub",))
        # Warm the model through the hub (activation loads it on the node).
        warm = {"model": "sim-small", "messages": [{"role": "user", "content": "warm"}]}
        wait_until(lambda: httpx.post(hub.url + "/v1/chat/completions", json=warm,
                                      timeout=60).status_code == 200,
                   60, "a 200 from the hub", interval=0.2)
        poll_cpu = page_poll_cpu(hub.url, hub.pid) if args.ui_polling else 0.0
        if args.ui_polling:
            threading.Thread(target=poll_like_the_page, args=(hub.url, stop_polling, polls),
                             daemon=True).start()
        time.sleep(1.0)
        idle_rss = {"hub": rss_mb(hub.pid), "node": rss_mb(node.pid), "engine": rss_mb(sim.pid)}
        pids = {"hub": hub.pid, "node": node.pid, "engine": sim.pid}
        targets = {"direct": sim.url, "node": node.url, "hub+node": hub.url}
        short = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 8}
        streamed = {"model": "sim-small", "messages": [{"role": "user", "content": "tell"}],
                    "max_tokens": STREAM_CHUNKS,
                    "stream": True}
        rows = []
        for kind, body, n, stream in (("short", short, args.requests, False),
                                      ("stream200", streamed, args.stream_requests, True)):
            for conc in (1, 32):
                base = None
                for tname, turl in targets.items():
                    url = turl + "/v1/chat/completions"
                    trio.run(run_load, url, body, max(conc, n // 10), conc, stream)  # warm-up
                    before = {k: cpu_seconds(p) for k, p in pids.items()}
                    lat, wall, chunks = trio.run(run_load, url, body, n, conc, stream)
                    after = {k: cpu_seconds(p) for k, p in pids.items()}
                    cpu = {k: after[k] - before[k] for k in pids}
                    p50, p99 = statistics.median(lat), pct(lat, 0.99)
                    rps = n / wall
                    if base is None:
                        base = (p50, p99, rps)
                    rows.append((kind, conc, tname, p50, p99, rps, p50 - base[0], p50 / base[0],
                                 rps / base[2],
                                 cpu["hub"] / n, cpu["node"] / n, cpu["engine"] / n,
                                 (cpu["hub"] / chunks if chunks else None), (cpu["node"] / chunks
                                                                             if chunks else None)))
        # The floors: an app answering two bytes behind our listener, served by the lean
        # server (plain TCP) and by hypercorn (TLS) (bench/floor_app.py).
        floors = all_floors(args.requests)
        translated = translated_rows(hub.url, hub.pid, args)
        print()
        print_floors(floors)
        if args.ui_polling:
            print(
                f"page polling on: {polls[0]} page requests to the hub during the run; one poll "
                "round costs the"
                  f" idle hub {poll_cpu * 1e3:.2f} ms CPU "
                  f"({poll_cpu / PAGE_POLL_SECONDS * 100:.2f}% of a core at one"
                  f" round every {PAGE_POLL_SECONDS:.0f} s)")
        print(
            f"idle RSS: hub {idle_rss['hub']:.1f} MB, node {idle_rss['node']:.1f} MB, sim engine "
            f"{idle_rss['engine']:.1f} MB")
        print(
            f"{'request':<10}{'conc':>5} "
            f"{'target':<9}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'+p50 ms':>9}"
              f"{'p50 x':>7}{'rps x':>7}{'hub ms/req':>11}{'node ms/req':>12}{'eng ms/req':>11}{'hub us/chunk':>13}{'node us/chunk':>14}")
        for (kind, conc, tname, p50, p99, rps, dp50, rp50, rrps, hcpu, ncpu, ecpu, hch,
             nch) in rows:
            print(
                f"{kind:<10}{conc:>5} "
                f"{tname:<9}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}{rps:>9.0f}{dp50 * 1e3:>9.2f}"
                  f"{rp50:>7.2f}{rrps:>7.2f}{hcpu * 1e3:>11.3f}{ncpu * 1e3:>12.3f}{ecpu * 1e3:>11.3f}"
                  f"{(hch * 1e6 if hch is not None else 0):>13.1f}{(nch * 1e6 if nch is not None else 0):>14.1f}")
        print(
            "\ntranslation, through the hub, concurrency 1 (base: OpenAI chat passed through to "
            "the openai engine)")
        print(
            f"{'request':<10} "
            f"{'route':<24}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}{'hub ms/req':>11}{'hub us/event':>13}")
        for kind, label, p50, p99, dp50, hcpu, hch in translated:
            print(
                f"{kind:<10} "
                f"{label:<24}{p50 * 1e3:>9.2f}{p99 * 1e3:>9.2f}{dp50 * 1e3:>9.2f}{hcpu * 1e3:>11.3f}"
                  f"{(hch * 1e6 if hch is not None else 0):>13.1f}")
    finally:
        stop_polling.set()
        procs.close()


SHORT = {"model": "sim-small", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def all_floors(n: int) -> dict[str, tuple[float, float]]:
    """The floors, each server in turn, then again in the other order (the lower figure of
    the two kept: a loaded box slows whichever ran under the load)."""
    with tempfile.TemporaryDirectory() as d:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
        from pki import make_pki  # trustme: a CA and a certificate for 127.0.0.1

        ca, cert, key = make_pki(Path(d))
        tls = (cert, key, ssl.create_default_context(cafile=ca))
        servers = ("lean server", "lean server TLS", "hypercorn")
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in servers}
        for order in (servers, servers[::-1]):
            for server in order:
                runs[server].append(floor_run(server, SHORT, n,
                                              tls if server.endswith("TLS") else None))
    return {s: min(r) for s, r in runs.items()}


def print_floors(floors: dict[str, tuple[float, float]]) -> None:
    for server, (floor_cpu, floor_p50) in floors.items():
        print(f"{server} floor (an ASGI app answering 2 bytes), concurrency 1: "
              f"{floor_cpu * 1e3:.3f} ms CPU per request, p50 {floor_p50 * 1e3:.2f} ms")
    plain, tls = floors.get("lean server"), floors.get("lean server TLS")
    if plain and tls:
        print(f"TLS adds {(tls[0] - plain[0]) * 1e3:.3f} ms CPU per request "
              f"({tls[0] / plain[0]:.2f}x plain), kept-alive connection")


def floor_run(server: str, body: dict, n: int,
              tls: tuple[str, str, ssl.SSLContext] | None = None) -> tuple[float, float]:
    """(CPU seconds per request, p50) of bench/floor_app.py served by `server` (`tls`:
    certificate, key and a client context that trusts it)."""
    argv = [sys.executable, os.path.join(os.path.dirname(__file__), "floor_app.py"),
            server.split()[0], *(tls[:2] if tls else ())]
    floor = subprocess.Popen(argv, stderr=subprocess.PIPE)
    verify: ssl.SSLContext | bool = tls[2] if tls else True
    try:
        url = floor.stderr.readline().decode().split()[-1]  # type: ignore[union-attr]
        trio.run(run_load, url + "/v1/chat/completions", body, 100, 1, False, verify)
        before = cpu_seconds(floor.pid)
        lat, _wall, _ = trio.run(run_load, url + "/v1/chat/completions", body, n, 1, False,
                                 verify)
        return (cpu_seconds(floor.pid) - before) / n, statistics.median(lat)
    finally:
        floor.kill()
        floor.wait()


def translated_rows(hub_url: str, hub_pid: int, args) -> list[tuple]:
    user = [{"role": "user", "content": "hi"}]
    routes = (("openai pass (oai)", "/v1/chat/completions", {"model": "sim-oai", "messages": user}),
              ("ollama pass (ollama)", "/api/chat", {"model": "sim-small", "messages": user}),
              ("ollama>openai", "/api/chat", {"model": "sim-oai", "messages": user}),
              ("anthropic>openai", "/v1/messages", {"model": "sim-oai", "messages": user}))
    rows = []
    for kind, n, stream, tokens in (("short", args.requests, False, 8),
                                    ("stream200", args.stream_requests, True, STREAM_CHUNKS)):
        base = None
        for label, path, body in routes:
            b = dict(body, stream=stream)
            b["options" if path == "/api/chat"
              else "max_tokens"] = {"num_predict": tokens} if path == "/api/chat" else tokens
            url = hub_url + path
            trio.run(run_load, url, b, max(1, n // 10), 1, stream)  # warm-up
            before = cpu_seconds(hub_pid)
            lat, _wall, chunks = trio.run(run_load, url, b, n, 1, stream)
            hub_cpu = cpu_seconds(hub_pid) - before
            p50 = statistics.median(lat)
            base = p50 if base is None else base
            rows.append((kind, label, p50, pct(lat, 0.99), p50 - base, hub_cpu / n,
                         hub_cpu / chunks if chunks else None))
    return rows


if __name__ == "__main__":
    main()
