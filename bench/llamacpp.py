"""Real llama.cpp behind the hub: a cold model's first token, and what hub + node add per token.

Run: .venv/bin/python bench/llamacpp.py [--requests N] [--tokens N]

Needs llama-cpp-python[server] in the venv (`make llamacpp-wheel`, tests/llama_cache.py).
Starts, on loopback, a real `appliance hub` and one `appliance node` (Engine__Kind=llamacpp,
Engine__Command = `python -m llama_cpp.server ...`, as tests/test_llamacpp_hub_e2e.py does)
with the seeded tiny GGUF of tests/make_gguf.py as an on-demand catalog model. Nothing is
loaded until the first request. Then, in one run:

1. Cold start. One streamed chat through the hub with the official `openai` client. The time
   from sending it to its first content token is split into three parts that add up to it.
   All timestamps are wall-clock ones on this one machine, with millisecond resolution:
   - placement: request sent -> the node logs `loading tiny`. This covers the hub taking
     the request, deciding where the model goes, and the load call reaching the node. The
     hub's `model_placing` audit event (Audit__Path) marks the decision inside it.
   - engine start: the node logs `loading tiny` -> it logs `tiny is ready`. This covers
     spawning `llama_cpp.server`, its imports, loading the GGUF, binding its port, and the
     node's readiness poll (every 100 ms) seeing it.
   - first token: `tiny is ready` -> the first content token reaches the client. This covers
     the hub learning the model is ready (its activation waiter polls every 250 ms, so up
     to 250 ms of it is that poll's phase), the request being proxied through hub and
     node, and the engine's prompt eval and first token (the warm `first event` below). The hub's `model_loaded` audit event (load call answered) marks a point inside it.
2. Per streamed token. N streamed chats of up to `--tokens` tokens each (greedy, same
   prompt), alternating between the llama.cpp server the node started (its port comes from
   the node's `serves tiny on port` log line) and the hub, after warm-ups. For each request:
   time to the first SSE event, the mean gap between events (first to last event, over
   events - 1), and the whole stream's time per event. Medians are printed, with what
   hub + node add and the ratio to the engine alone. Also printed: the CPU the hub and the
   node spent on the streamed requests (/proc utime + stime), per request and per event.
   On a machine with few cores the engine, hub, node and client share them, so the
   per-event figures move from run to run; the CPU figures are the steadier ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import make_gguf  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

TOKEN = "bench-llamacpp"
COMMAND = (f"{shlex.quote(sys.executable)} -m llama_cpp.server --model {{model}} --host 127.0.0.1 "
           "--port {port} --n_ctx 256 {args}")
MESSAGES = [{"role": "user", "content": "hi"}]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


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


def stream_once(client: httpx.Client, url: str, body: dict) -> tuple[float, float, float, int]:
    """(time to first event, mean gap between events, time per event, events) for one stream."""
    t0 = time.perf_counter()
    first = last = None
    n = 0
    with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, (r.status_code, r.read()[:200])
        for line in r.iter_lines():
            if line.startswith("data: {"):
                last = time.perf_counter()
                first = first or last
                n += 1
    assert n >= 2, f"{url}: {n} events"
    return first - t0, (last - first) / (n - 1), (last - t0) / n, n


def per_token(hub, node, engine_url: str, requests: int, tokens: int) -> dict:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": tokens, "stream": True,
            "temperature": 0, "seed": 3}
    targets = {"engine alone": engine_url + "/v1/chat/completions",
               "hub+node": hub.url + "/v1/chat/completions"}
    timeout = httpx.Timeout(60, connect=5)
    results: dict[str, list] = {k: [] for k in targets}
    cpu = {"hub": 0.0, "node": 0.0}
    events = {"hub+node": 0}
    with httpx.Client(timeout=timeout) as direct, httpx.Client(timeout=timeout) as via:
        clients = {"engine alone": direct, "hub+node": via}
        for _ in range(3):  # warm-up: connections, the engine's prompt cache
            for name, url in targets.items():
                stream_once(clients[name], url, body)
        for _ in range(requests):
            for name, url in targets.items():
                before = (cpu_seconds(hub.pid), cpu_seconds(node.pid))
                got = stream_once(clients[name], url, body)
                if name == "hub+node":
                    cpu["hub"] += cpu_seconds(hub.pid) - before[0]
                    cpu["node"] += cpu_seconds(node.pid) - before[1]
                    events["hub+node"] += got[3]
                results[name].append(got)
    med = {name: tuple(statistics.median(r[i] for r in rs) for i in range(4)) for name,
           rs in results.items()}
    return {"median": med, "cpu_per_event": {k: v / events["hub+node"] for k, v in cpu.items()},
            "cpu_per_request": {k: v / requests for k, v in cpu.items()},
            "event_counts": {name: sorted({r[3] for r in rs}) for name, rs in results.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=50, help="timed streamed requests per target")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each streamed request")
    args = ap.parse_args()
    t_run = time.monotonic()
    load = os.getloadavg()[
        0]  # this machine's CPUs are shared: a busy one slows the per-token figures
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="bench-llamacpp-") as tmp:
        tiny = make_gguf.write(Path(tmp) / "tiny.gguf", seed=11)
        gguf_kib = tiny.stat().st_size // 1024
        audit_path = os.path.join(tmp, "audit.jsonl")
        try:
            node = procs.node("gpu-a", {"Engine__Kind": "llamacpp", "Engine__Command": COMMAND,
                                        "Auth__NodeToken": TOKEN,
                                        "Engine__StartTimeoutSeconds": "60",
                                        "Node__MemoryMb": "2000"})
            hub = procs.hub({"Auth__NodeToken": TOKEN, "Audit__Path": audit_path,
                             "Nodes__0__Name": "gpu-a", "Nodes__0__Url": node.url,
                             "Models__0__Name": "tiny", "Models__0__Source": str(tiny)},
                            metrics=False)
            wait_until(lambda: [n["status"] for n in httpx.get(hub.url + "/api/status",
                                                               timeout=10).json()["nodes"]]
                       == ["up"], 30, "node up at the hub")
            assert not any("loading tiny" in ln
                           for ln in list(node.stderr_lines)), "tiny loaded before the request"
            cold = cold_start(hub, node, audit_path)
            port = re.search(r"on port (\d+)", log_line(node, r"serves tiny on port")).group(1)
            tok = per_token(hub, node, f"http://127.0.0.1:{port}", args.requests, args.tokens)
        finally:
            procs.close()

    ms = 1e3
    print(f"\nllama.cpp (llama-cpp-python server, tiny GGUF {gguf_kib} KiB) behind appliance: "
          f"hub + 1 node on loopback, {os.cpu_count()} CPUs, load average {load:.2f} at the start")
    print("\ncold model, first request through the hub (streamed, openai client):")
    print(
        f"  {'placement':<14}{cold['placement'] * ms:>9.0f} ms  request sent -> node logs `loading "
        "tiny`"
          f" (hub's placement decision at +{cold['decided'] * ms:.0f} ms)")
    print(
        f"  {'engine start':<14}{cold['engine'] * ms:>9.0f} ms  node `loading tiny` -> `tiny is "
        "ready`"
          f" (llama_cpp.server spawned at +{cold['spawned'] * ms:.0f} ms)")
    print(
        f"  {'first token':<14}{cold['first'] * ms:>9.0f} ms  `tiny is ready` -> first content "
        "token at the client"
          f" (hub has the load answer at +{cold['loaded'] * ms:.0f} ms)")
    print(f"  {'total':<14}{cold['total'] * ms:>9.0f} ms  request sent -> first content token")
    med = tok["median"]
    e, h = med["engine alone"], med["hub+node"]
    print(
        f"\nstreamed chats, {args.requests} per target, alternating, max_tokens {args.tokens}, "
        "medians"
          f" (events per request: engine {tok['event_counts']['engine alone']}, hub "
          f"{tok['event_counts']['hub+node']}):")
    print(f"  {'target':<14}{'first event ms':>15}{'gap/event ms':>14}{'wall/event ms':>15}")
    for name, m in med.items():
        print(f"  {name:<14}{m[0] * ms:>15.2f}{m[1] * ms:>14.3f}{m[2] * ms:>15.3f}")
    print(
        "  "
        f"{'hub+node adds':<14}{(h[0] - e[0]) * ms:>15.2f}{(h[1] - e[1]) * ms:>14.3f}{(h[2] - e[2]) * ms:>15.3f}")
    print(f"  {'ratio':<14}{h[0] / e[0]:>14.2f}x{h[1] / e[1]:>13.2f}x{h[2] / e[2]:>14.2f}x")
    cpr, cpe = tok["cpu_per_request"], tok["cpu_per_event"]
    print(
        f"  CPU spent through hub+node: hub {cpr['hub'] * ms:.1f} ms per request = "
        f"{cpe['hub'] * 1e6:.0f} us per event,"
          f" node {cpr['node'] * ms:.1f} ms = {cpe['node'] * 1e6:.0f} us")
    print(f"\n(run took {time.monotonic() - t_run:.0f} s)")


if __name__ == "__main__":
    main()
