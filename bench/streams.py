"""Token streams at scale: N streams at R tokens/s through hub + node, the engine alone, nginx.

Run: .venv/bin/python bench/streams.py [--rate 50] [--streams 8,16,32,64,128] [--seconds 6]
     .venv/bin/python bench/streams.py --rate 1000 --streams 4,8 --seconds 5     # the stress
     .venv/bin/python bench/streams.py --workers 1,2 ...                         # compare hubs

Starts real processes on loopback: `appliance sim` paced at R tokens/s per stream
(Sim__TokensPerSecond, the engine), an `appliance node` in front of it (Engine__Kind=openai:
the stream is passed through), an `appliance hub` knowing that node, and -- when Debian's
`nginx` is installed (`apt-get install nginx-light`; the bench runs without it and says
so) -- nginx as a plain streaming proxy to the same sim (proxy_buffering off), the floor
a proxy hop can reach. For each N in --streams, side by side in one run (the ratios
matter on a shared machine), N concurrent streamed chat requests run for --seconds
against each target, each restarted as soon as it ends (max_tokens = 2 s of tokens, or
--stream-seconds: the CPU per event includes each request's own cost, spread over its events).

The load generator is a raw-socket trio client (no httpx: its per-chunk cost would be
the bottleneck at 1 kHz): it counts SSE `data:` events and the gap between consecutive
events of a stream as they arrive. Per target and N it prints events/s, the p50 and p99
gap (the engine paces at 1/R: what a proxy adds shows in the p99), and the CPU each
process spent per event, read from /proc (utime + stime) -- CPU per event per hop is
the figure of merit (issue 15: <= 50 us per paced event per hop, nginx ~ 30 us).

N is raised until the hub adds more than 5 ms to the p99 gap against the engine alone
at the same N (or the list ends); at that point it prints events/s per hub core and per
node core (1 / CPU per event) and what a 16-core hub box would carry by that figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
import procfs  # noqa: E402
from procs import Procs, free_port, wait_until  # noqa: E402

MODEL = "sim-small"
# The hub adds more than this to the p99 gap between tokens: saturated.
P99_BUDGET = 0.005


def cpu_seconds(pids: list[int], kernel_only: bool = False) -> float:
    """utime + stime of `pids` (stime only with kernel_only: the syscalls' share); a
    process gone counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            total += procfs.cpu_seconds(pid, kernel_only)
        except OSError:
            continue
    return total


def children(pid: int) -> list[int]:
    """pid and its descendants (a multi-worker hub, nginx's workers)."""
    return [pid, *procfs.descendants(pid)]


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


class Load:
    """N closed-loop streams against one target; events and gaps as they arrive."""

    def __init__(self, host: str, port: int, tokens: int) -> None:
        self.host, self.port = host, port
        body = (b'{"model":"%s","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"tell"}]}'
                % (MODEL.encode(), tokens))
        self.req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % (host.encode(), port, len(body))) + body
        self.events = 0
        self.gaps: list[float] = []
        self.errors = 0
        self.reads = 0
        self.wall = 0.0

    async def stream_loop(self, until: float) -> None:
        sock = None
        while time.monotonic() < until:
            try:
                if sock is None:
                    sock = await trio.open_tcp_stream(self.host, self.port)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if not await self._one(sock, until):
                    await sock.aclose()
                    sock = None
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                self.errors += 1
                sock = None
                await trio.sleep(0.05)
        if sock is not None:
            await sock.aclose()

    async def _one(self, sock, until: float) -> bool:
        """One request; True when the connection may be reused (chunked body ended)."""
        await sock.send_all(self.req)
        buf = b""
        last = None
        gaps, first = self.gaps, True
        while True:
            data = await sock.receive_some(65536)
            if not data:
                return False
            now = time.perf_counter()
            self.reads += 1
            if first:
                first = False
                if not data.startswith(b"HTTP/1.1 200"):
                    self.errors += 1
                    return False
            n = data.count(b"data: {")
            if n:
                if last is not None:
                    gaps.append(now - last)
                    gaps.extend([0.0] * (n - 1))
                self.events += n
                last = now
            buf = (buf + data)[-16:]
            if buf.endswith(b"0\r\n\r\n"):
                return time.monotonic() < until


async def run_target(host: str, port: int, n: int, seconds: float, tokens: int) -> Load:
    load = Load(host, port, tokens)
    t0 = time.monotonic()
    until = t0 + seconds
    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(load.stream_loop, until)
            await trio.sleep(0.3 / n)  # spread the starts: streams' tokens do not all fall together
    load.wall = time.monotonic() - t0  # streams end after `until`: the last one runs to its end
    return load


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}; proxy_temp_path {dir}; fastcgi_temp_path {dir};
  uwsgi_temp_path {dir}; scgi_temp_path {dir};
  upstream engine {{ server {upstream}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://engine;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""


def start_nginx(upstream: str) -> tuple[subprocess.Popen, int] | None:
    exe = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)
    if exe is None:
        print("nginx: not installed (apt-get install nginx-light); its rows are left out", file=sys.stderr)
        return None
    d = tempfile.mkdtemp(prefix="bench-nginx-")
    port = free_port()
    with open(os.path.join(d, "nginx.conf"), "w") as f:
        f.write(NGINX_CONF.format(dir=d, upstream=upstream, port=port))
    p = subprocess.Popen([exe, "-p", d, "-c", os.path.join(d, "nginx.conf")], stderr=subprocess.DEVNULL)

    def up() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    wait_until(up, what="nginx listening")
    return p, port


def start_profiles(d: str, pids: dict[str, int], seconds: float) -> list:
    """py-spy (pip install py-spy; needs ptrace) on each pid for the run; collapsed stacks."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(d, exist_ok=True)
    out = []
    for role, pid in pids.items():
        path = os.path.join(d, f"{role}.txt")
        spy = subprocess.Popen([exe, "record", "--nonblocking", "-r", "250", "-d", str(max(1, int(seconds) - 1)),
                                "-f", "raw", "-o", path, "-p", str(pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append((role, spy, path))
    return out


def summarize(role: str, path: str, top: int = 14) -> None:
    """Self time by module and function, and inclusive time by module, from collapsed stacks."""
    selfs: dict[str, int] = {}
    incl: dict[str, int] = {}
    total = 0
    try:
        lines = open(path).read().splitlines()
    except OSError:
        print(f"  profile {role}: none ({path})")
        return
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        total += c
        frames = stack.split(";")
        leaf = frames[-1]
        selfs[_short(leaf)] = selfs.get(_short(leaf), 0) + c
        for mod in {_module(f) for f in frames}:
            incl[mod] = incl.get(mod, 0) + c
    print(f"  profile {role}: {total} samples; self time by function:")
    for k, v in sorted(selfs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {v / total * 100:5.1f}%  {k}")
    print(f"  {role}: inclusive time by module:")
    for k, v in sorted(incl.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {v / total * 100:5.1f}%  {k}")


def _module(frame: str) -> str:
    # py-spy raw frames: "function (path/to/module.py:line)"
    path = frame.rpartition("(")[2].rstrip(")").rpartition(":")[0]
    parts = path.split("/")
    if "site-packages" in parts:
        i = parts.index("site-packages")
        return "/".join(parts[i + 1:i + 3])
    if "appliance" in parts:
        return "/".join(parts[parts.index("appliance"):])
    return "/".join(parts[-2:])


def _short(frame: str) -> str:
    fn, _, rest = frame.partition(" (")
    return f"{fn} ({_module(frame)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream (the engine's pace)")
    ap.add_argument("--streams", default="8,16,32,64,128", help="the N to try, in order")
    ap.add_argument("--seconds", type=float, default=6.0, help="per target and N")
    ap.add_argument("--workers", "--hub-workers", dest="hub_workers", default="",
                    help="Hub__Workers values to compare, e.g. 1,2 (default: the hub's default)")
    ap.add_argument("--no-nginx", action="store_true")
    ap.add_argument("--profile", default="", help="DIR: py-spy records the hub and the node (collapsed stacks)"
                    " during hub+node at the first N, and prints where their time goes")
    ap.add_argument("--targets", default="engine,nginx,node,hub+node")
    ap.add_argument("--stream-seconds", type=float, default=2.0,
                    help="each stream's length in seconds of tokens (max_tokens = rate x this): the"
                    " request's own cost is spread over its events; longer streams show the relay's")
    args = ap.parse_args()
    ns = [int(x) for x in args.streams.split(",")]
    tokens = max(4, int(args.rate * args.stream_seconds))
    procs = Procs()
    nginx = None
    try:
        sim = procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": str(args.rate),
                                  "Sim__Parallel": "4096"})
        node = procs.start("node", {"Node__Name": "bench", "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                                    "Engine__Kind": "openai", "Engine__Url": sim.url, "Node__ModelSlots": "4096"})
        hubs = {}
        for w in (args.hub_workers.split(",") if args.hub_workers else [""]):
            env = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Audit__Path": os.devnull,
                   "Nodes__0__Name": "bench", "Nodes__0__Url": node.url, "Queue__MaxDepth": "4096"}
            if w:
                env["Hub__Workers"] = w
            hubs["hub+node" + (f" w={w}" if w else "")] = procs.start("hub", env, wait=("hub",))
        for hub in hubs.values():
            wait_until(lambda: _warm(hub.url), timeout=60, what="the model answering through the hub")
        targets: dict[str, tuple[str, int, list[int]]] = {}
        wanted = args.targets.split(",")
        if "engine" in wanted:
            targets["engine"] = (*_hp(sim.url), [])
        if "nginx" in wanted and not args.no_nginx:
            nginx = start_nginx(_hp(sim.url)[0] + ":" + str(_hp(sim.url)[1]))
            if nginx:
                targets["nginx"] = ("127.0.0.1", nginx[1], [nginx[0].pid])
        if "node" in wanted:
            targets["node"] = (*_hp(node.url), [node.pid])
        if "hub+node" in wanted:
            for name, hub in hubs.items():
                targets[name] = (*_hp(hub.url), [hub.pid, node.pid])
        print(f"rate {args.rate:g} tokens/s per stream, {args.seconds:g} s per target and N, pids: sim {sim.pid}"
              f" node {node.pid} hubs {[h.pid for h in hubs.values()]}", flush=True)
        print(f"{'N':>5} {'target':<14}{'events/s':>10}{'p50 gap ms':>11}{'p99 gap ms':>11}{'errors':>7}"
              f"{'ev/read':>8}{'engine us/ev':>13}{'proxy us/ev':>12}{'node us/ev':>11}{'hub us/ev':>10}", flush=True)
        knee = None
        for n in ns:
            base_p99 = None
            hub_worst = 0.0
            row_hub = None
            nginx_us = 0.0
            for tname, (host, port, proxy_pids) in targets.items():
                pids = {"engine": children(sim.pid), "node": [node.pid],
                        "proxy": [p for pid in proxy_pids if pid != node.pid for p in children(pid)]}
                before = {k: cpu_seconds(v) for k, v in pids.items()}
                before_sys = cpu_seconds(pids["proxy"], kernel_only=True)
                spies = []
                if args.profile and tname.startswith("hub") and n == ns[0]:
                    spies = start_profiles(args.profile, {"hub": proxy_pids[0], "node": node.pid}, args.seconds)
                load = trio.run(run_target, host, port, n, args.seconds, tokens)
                for role, spy, path in spies:
                    spy.wait(30)
                    summarize(role, path)
                cpu = {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
                proxy_sys = cpu_seconds(pids["proxy"], kernel_only=True) - before_sys
                ev = max(1, load.events)
                p50, p99 = pct(load.gaps, 0.5), pct(load.gaps, 0.99)
                if tname == "engine":
                    base_p99 = p99
                node_us = cpu["node"] / ev * 1e6 if node.pid in proxy_pids else 0.0
                proxy_us = cpu["proxy"] / ev * 1e6 if tname not in ("engine",) else 0.0
                hub_us = proxy_us if tname.startswith("hub") else 0.0
                if tname == "nginx":
                    nginx_us = proxy_us
                print(f"{n:>5} {tname:<14}{load.events / load.wall:>10.0f}{p50 * 1e3:>11.2f}{p99 * 1e3:>11.2f}"
                      f"{load.errors:>7}{load.events / max(1, load.reads):>8.2f}{cpu['engine'] / ev * 1e6:>13.1f}"
                      f"{(proxy_us if not tname.startswith('hub') else 0):>12.1f}{node_us:>11.1f}{hub_us:>10.1f}"
                      f"{(proxy_sys / cpu['proxy'] * 100 if cpu['proxy'] else 0):>15.0f}",
                      flush=True)
                if tname.startswith("hub") and base_p99 is not None:
                    hub_worst = max(hub_worst, p99 - base_p99)
                    row_hub = (n, load.events / load.wall, hub_us, node_us, nginx_us)
            if row_hub is not None:
                knee = row_hub
                if hub_worst > P99_BUDGET:
                    print(f"  -> at N={n} the hub adds {hub_worst * 1e3:.1f} ms to the p99 gap (> {P99_BUDGET * 1e3:g} ms):"
                          " stop", flush=True)
                    break
        if knee:
            n, evs, hub_us, node_us, nginx_us = knee
            print(f"\nat N={n}: {evs:.0f} events/s through hub + node;"
                  f" {1e6 / hub_us if hub_us else 0:,.0f} events/s per hub core,"
                  f" {1e6 / node_us if node_us else 0:,.0f} per node core;"
                  f" a 16-core hub box: ~{16e6 / hub_us if hub_us else 0:,.0f} events/s"
                  f" (~{16e6 / hub_us / args.rate if hub_us else 0:,.0f} streams at {args.rate:g} tokens/s)")
            if nginx_us:
                print(f"CPU per event against nginx's {nginx_us:.1f} us: hub {hub_us / nginx_us:.1f}x,"
                      f" node {node_us / nginx_us:.1f}x")
    finally:
        if nginx:
            nginx[0].terminate()
            nginx[0].wait(5)
        procs.close()


def _hp(url: str) -> tuple[str, int]:
    hostport = url.split("://", 1)[1].rstrip("/")
    h, _, p = hostport.rpartition(":")
    return h.strip("[]"), int(p)


def _warm(url: str) -> bool:
    import httpx
    try:
        r = httpx.post(url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "warm"}], "max_tokens": 2})
        return r.status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    main()
