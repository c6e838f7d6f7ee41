"""Real llama.cpp behind the hub: a cold model's first token, and what hub + node add per token.

Run: .venv/bin/python bench/llamacpp.py [--server llama-server|llama_cpp|both]
                                        [--requests N] [--tokens N]

Runs on the real servers the `llamacpp` tests run on (tests/harness/llama_cache.py, the same
Engine__Command as tests/conftest.py's `real_server`): llama.cpp's own `llama-server` (the
cached build, `make llama-server`) and llama-cpp-python's `python -m llama_cpp.server`
(`make llamacpp-wheel`). `--server both` (the default) runs each that is installed, side by
side in one run; one that is not is skipped with a line saying why. Per server it starts,
on loopback, a real `appliance hub` and one `appliance node` (Engine__Kind=llamacpp, that
server's Engine__Command) with the seeded tiny GGUF of tests/harness/make_gguf.py as an on-demand
catalog model. Nothing is loaded until the first request. Then, in one run:

1. Cold start. One streamed chat through the hub with the official `openai` client. The time
   from sending it to its first content token is split into three parts that add up to it.
   All timestamps are wall-clock ones on this one machine, with millisecond resolution:
   - placement: request sent -> the node logs `loading tiny`. This covers the hub taking
     the request, deciding where the model goes, and the load call reaching the node. The
     hub's `model_placing` audit event (Audit__Path) marks the decision inside it.
   - engine start: the node logs `loading tiny` -> it logs `tiny is ready`. This covers
     spawning the server, its imports, loading the GGUF, binding its port, and the
     node's readiness poll (every 100 ms) seeing it.
   - first token: `tiny is ready` -> the first content token reaches the client. This covers
     the hub learning the model is ready (its activation waiter polls every 250 ms, so up
     to 250 ms of it is that poll's phase), the request being proxied through hub and
     node, and the engine's prompt eval and first token (the warm `first event` below). The hub's `model_loaded` audit event (load call answered) marks a point inside it.
   The cold starts run one server after the other.
2. Per streamed token. N streamed chats of up to `--tokens` tokens each (greedy, same
   prompt), alternating between the llama.cpp server the node started (its port comes from
   the node's `serves tiny on port` log line) and the hub, after warm-ups; with both
   servers, each round goes through all four targets, so both see the same load. For each request:
   time to the first SSE event, the mean gap between events (first to last event, over
   events - 1), and the whole stream's time per event. Medians are printed, with what
   hub + node add and the ratio to the engine alone. Also printed: the CPU the hub and the
   node spent on the streamed requests (/proc utime + stime), per request and per event.
   On a machine with few cores the engine, hub, node and client share them, so the
   per-event figures move from run to run; the CPU figures are the steadier ones.
3. With both servers: each figure of llama-server against llama_cpp.server's, as a ratio.
   Both run one thread (llama-server `-t 1`; llama-cpp-python's default is half the cores).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "harness"))
import llama_cache  # noqa: E402
import make_gguf  # noqa: E402
from procfs import cpu_seconds  # noqa: E402
from procs import Proc, Procs, wait_until  # noqa: E402

TOKEN = "bench-llamacpp"
SERVERS = {"llama-server": llama_cache.llama_server,
           "llama_cpp": llama_cache.llama_cpp_python_server}
TARGETS = ("engine alone", "hub+node")
MESSAGES = [{"role": "user", "content": "hi"}]


def log_ts(line: str) -> float:
    """Wall-clock time of a `%(asctime)s ...` log line (`YYYY-mm-dd HH:MM:SS,mmm`)."""
    return time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1000


def log_line(proc, pattern: str) -> str:
    rx = re.compile(pattern)
    return next(ln for ln in list(proc.stderr_lines) if rx.search(ln))


def audit_ts(path: str, kind: str, model: str) -> float | None:
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == kind and rec.get("model") == model:
                return rec["ts"]
    return None


def cold_start(hub, node, audit_path: str) -> dict[str, float]:
    client = openai.OpenAI(base_url=hub.url + "/v1", api_key="anyone", timeout=120, max_retries=0)
    t0 = time.time()
    first = None
    pieces = 0
    for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.time()
            pieces += 1
    assert first is not None and pieces >= 2, f"cold stream gave {pieces} tokens"
    loading = log_ts(log_line(node, r"loading tiny \(source"))
    spawned = log_ts(log_line(node, r"serves tiny on port"))
    ready = log_ts(log_line(node, r"tiny is ready"))
    placing = wait_until(lambda: audit_ts(audit_path, "model_placing", "tiny"), 5,
                         "model_placing audit event")
    loaded = wait_until(lambda: audit_ts(audit_path, "model_loaded", "tiny"), 5,
                        "model_loaded audit event")
    return {"total": first - t0, "placement": loading - t0, "engine": ready - loading,
            "first": first - ready,
            "decided": placing - t0, "spawned": spawned - loading, "loaded": loaded - ready}


def stream_once(client: httpx.Client, url: str, body: dict) -> tuple[float, float, float, int,
                                                                     float]:
    """(time to first event, mean gap between events, time per event, events, time per
    token) for one stream. Time per token is the whole stream over max_tokens when it ended
    on `length` (it made them all), NaN otherwise: llama-server holds back a token that ends
    inside a UTF-8 character and sends it with the next, so its events are fewer than its
    tokens, while llama_cpp.server sends one per token."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    finish = None
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, (r.status_code, r.read()[:200])
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                n += 1
                choices = json.loads(line[6:]).get("choices") or [{}]
                finish = choices[0].get("finish_reason") or finish
    assert n >= 2 and first is not None and last is not None, f"{url}: {n} events"
    per_token = (last - t0) / body["max_tokens"] if finish == "length" else math.nan
    return first - t0, (last - first) / (n - 1), (last - t0) / n, n, per_token


@dataclass
class Rig:
    """One server's hub + node, and the figures measured on it."""

    server: llama_cache.RealServer
    hub: Proc
    node: Proc
    audit_path: str
    engine_url: str = ""
    cold: dict[str, float] | None = None
    results: dict[str, list] | None = None
    cpu: dict[str, float] | None = None
    events: int = 0


def start(procs: Procs, server: llama_cache.RealServer, tiny: Path, tmp: str) -> Rig:
    audit_path = os.path.join(tmp, f"audit-{server.name}.jsonl")
    node = procs.node("gpu-a", {"Engine__Kind": "llamacpp", "Engine__Command": server.command,
                                "Auth__NodeToken": TOKEN, "Engine__StartTimeoutSeconds": "60",
                                "Node__MemoryMb": "2000"})
    hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": audit_path,
                     "Nodes__0__Name": "gpu-a", "Nodes__0__Url": node.url,
                     "Models__0__Name": "tiny", "Models__0__Source": str(tiny)}, metrics=False)
    wait_until(lambda: [n["status"] for n in httpx.get(hub.url + "/api/status",
                                                       timeout=10).json()["nodes"]] == ["up"],
               30, "node up at the hub")
    assert not any("loading tiny" in ln
                   for ln in list(node.stderr_lines)), "tiny loaded before the request"
    return Rig(server, hub, node, audit_path)


def per_token(rigs: list[Rig], requests: int, tokens: int) -> None:
    """Alternating streams: each round, every rig's engine alone then its hub + node."""
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": tokens, "stream": True,
            "temperature": 0, "seed": 3}
    timeout = httpx.Timeout(60, connect=5)
    clients = {(i, t): httpx.Client(timeout=timeout) for i in range(len(rigs)) for t in TARGETS}
    try:
        for rig in rigs:
            rig.results, rig.cpu, rig.events = {t: [] for t in TARGETS}, {"hub": 0.0,
                                                                          "node": 0.0}, 0

        def url(rig: Rig, target: str) -> str:
            base = rig.engine_url if target == "engine alone" else rig.hub.url
            return base + "/v1/chat/completions"

        for _ in range(3):  # warm-up: connections, the engine's prompt cache
            for i, rig in enumerate(rigs):
                for t in TARGETS:
                    stream_once(clients[i, t], url(rig, t), body)
        for _ in range(requests):
            for i, rig in enumerate(rigs):
                assert rig.results is not None and rig.cpu is not None
                for t in TARGETS:
                    before = (cpu_seconds(rig.hub.pid), cpu_seconds(rig.node.pid))
                    got = stream_once(clients[i, t], url(rig, t), body)
                    if t == "hub+node":
                        rig.cpu["hub"] += cpu_seconds(rig.hub.pid) - before[0]
                        rig.cpu["node"] += cpu_seconds(rig.node.pid) - before[1]
                        rig.events += got[3]
                    rig.results[t].append(got)
    finally:
        for c in clients.values():
            c.close()


def medians(rig: Rig) -> dict[str, tuple[float, ...]]:
    assert rig.results is not None
    return {t: tuple(statistics.median(r[i] for r in rs) for i in (0, 1, 2, 3, 4))
            for t, rs in rig.results.items()}


def report(rig: Rig, requests: int, tokens: int) -> None:
    ms = 1e3
    cold, name = rig.cold, rig.server.name
    assert cold is not None and rig.results is not None and rig.cpu is not None
    print(f"\n== {name} ==")
    print("cold model, first request through the hub (streamed, openai client):")
    print(f"  {'placement':<14}{cold['placement'] * ms:>9.0f} ms  request sent -> node logs "
          f"`loading tiny` (hub's placement decision at +{cold['decided'] * ms:.0f} ms)")
    print(f"  {'engine start':<14}{cold['engine'] * ms:>9.0f} ms  node `loading tiny` -> "
          f"`tiny is ready` ({name} spawned at +{cold['spawned'] * ms:.0f} ms)")
    print(f"  {'first token':<14}{cold['first'] * ms:>9.0f} ms  `tiny is ready` -> first "
          f"content token at the client (hub has the load answer at +{cold['loaded'] * ms:.0f} ms)")
    print(f"  {'total':<14}{cold['total'] * ms:>9.0f} ms  request sent -> first content token")
    med = medians(rig)
    e, h = med["engine alone"], med["hub+node"]
    counts = {t: sorted({r[3] for r in rs}) for t, rs in rig.results.items()}
    print(f"streamed chats, {requests} per target, alternating, max_tokens {tokens}, medians "
          f"(events per request: engine {counts['engine alone']}, hub {counts['hub+node']}):")
    print(f"  {'target':<14}{'first event ms':>15}{'gap/event ms':>14}{'wall/event ms':>15}"
          f"{'wall/token ms':>15}")
    for t, m in med.items():
        print(f"  {t:<14}{m[0] * ms:>15.2f}{m[1] * ms:>14.3f}{m[2] * ms:>15.3f}"
              f"{m[4] * ms:>15.3f}")
    print(f"  {'hub+node adds':<14}{(h[0] - e[0]) * ms:>15.2f}{(h[1] - e[1]) * ms:>14.3f}"
          f"{(h[2] - e[2]) * ms:>15.3f}{(h[4] - e[4]) * ms:>15.3f}")
    print(f"  {'ratio':<14}{h[0] / e[0]:>14.2f}x{h[1] / e[1]:>13.2f}x{h[2] / e[2]:>14.2f}x"
          f"{h[4] / e[4]:>14.2f}x")
    cpu, ev = rig.cpu, max(rig.events, 1)
    print(f"  CPU spent through hub+node: hub {cpu['hub'] / requests * ms:.1f} ms per request = "
          f"{cpu['hub'] / ev * 1e6:.0f} us per event, node {cpu['node'] / requests * ms:.1f} ms"
          f" = {cpu['node'] / ev * 1e6:.0f} us")


def compare(a: Rig, b: Rig) -> None:
    """a's figures against b's, side by side, with a / b."""
    ms = 1e3
    assert a.cold is not None and b.cold is not None and a.cpu and b.cpu
    rows: list[tuple[str, float, float]] = [
        (f"cold {k}", a.cold[k] * ms, b.cold[k] * ms)
        for k in ("placement", "engine", "first", "total")]
    ma, mb = medians(a), medians(b)
    for t in TARGETS:
        for i, what in ((0, "first event"), (1, "gap/event"), (2, "wall/event"),
                        (4, "wall/token")):
            rows.append((f"{t} {what}", ma[t][i] * ms, mb[t][i] * ms))
    for i, what in ((2, "wall/event"), (4, "wall/token")):
        rows.append((f"hub+node adds, {what}", (ma["hub+node"][i] - ma["engine alone"][i]) * ms,
                     (mb["hub+node"][i] - mb["engine alone"][i]) * ms))
    for proc in ("hub", "node"):
        rows.append((f"{proc} CPU/event", a.cpu[proc] / max(a.events, 1) * ms,
                     b.cpu[proc] / max(b.events, 1) * ms))
    print(f"\n== {a.server.name} vs {b.server.name} (ms; ratio = {a.server.name} / "
          f"{b.server.name}) ==")
    print(f"  {'figure':<30}{a.server.name:>14}{b.server.name:>18}{'ratio':>9}")
    for label, x, y in rows:
        ratio = f"{x / y:>8.2f}x" if y > 0 else f"{'-':>9}"
        print(f"  {label:<30}{x:>14.3f}{y:>18.3f}{ratio}")


def chosen(which: str) -> list[llama_cache.RealServer]:
    """The servers to run; one that is not installed here is skipped with a line saying so."""
    names = list(SERVERS) if which == "both" else [which]
    out = []
    for name in names:
        server = SERVERS[name]()
        if server.missing:
            print(f"skipping {server.name}: {server.missing}", flush=True)
        else:
            out.append(server)
    if not out:
        sys.exit("no llama.cpp server to run: " + ", ".join(names) + " not installed")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=[*SERVERS, "both"], default="both",
                    help="which real server the node runs (both: side by side, one run)")
    ap.add_argument("--requests", type=int, default=50, help="timed streamed requests per target")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each streamed request")
    args = ap.parse_args()
    if args.requests < 1 or args.tokens < 2:
        ap.error("--requests must be >= 1 and --tokens >= 2")
    servers = chosen(args.server)
    t_run = time.monotonic()
    load = os.getloadavg()[0]  # this machine's CPUs are shared: a busy one slows the figures
    procs = Procs()
    rigs: list[Rig] = []
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        tiny = make_gguf.write(Path(tmp) / "tiny.gguf", seed=11)
        gguf_kib = tiny.stat().st_size // 1024
        try:
            for server in servers:  # cold starts one after the other
                rig = start(procs, server, tiny, tmp)
                rig.cold = cold_start(rig.hub, rig.node, rig.audit_path)
                line = log_line(rig.node, r"serves tiny on port")
                port = re.search(r"on port (\d+)", line)
                assert port is not None, line
                rig.engine_url = f"http://127.0.0.1:{port.group(1)}"
                rigs.append(rig)
            per_token(rigs, args.requests, args.tokens)
        finally:
            procs.close()

    print(f"\nllama.cpp ({', '.join(r.server.name for r in rigs)}; tiny GGUF {gguf_kib} KiB) "
          f"behind appliance: hub + 1 node per server on loopback, {os.cpu_count()} CPUs, "
          f"load average {load:.2f} at the start")
    for rig in rigs:
        report(rig, args.requests, args.tokens)
    if len(rigs) == 2:
        compare(rigs[0], rigs[1])
    print(f"\n(run took {time.monotonic() - t_run:.0f} s)")


if __name__ == "__main__":
    main()
