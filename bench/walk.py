"""The walk of one streamed chat: files and distinct functions of `appliance/` each process enters.

Run: .venv/bin/python bench/walk.py [--list hub|node|all] [--json PATH]

Starts real processes on loopback, as bench/streams.py does: `appliance sim` (the engine),
an `appliance node` in front of it (Engine__Kind=openai: an OpenAI-speaking engine, the
stream passed through) and an `appliance hub` knowing that node (Hub__Workers=1, plain
TCP, affinity on). Node and hub run under this file (`--child ROLE`), which installs a
profile hook (sys.setprofile) that records every Python function entered in `appliance/`
between SIGUSR1 and SIGUSR2. Two streamed chats warm the path (model ready, pooled
connection to the node); then both processes are told to record, one streamed chat
completion (`"stream": true`, a fresh client connection) runs to its end, and they stop.

Printed per process: files, distinct functions, calls (a coroutine's resume counts as a
call; comprehensions and lambdas are functions too). With --list, the functions in the
order first entered, by file. The loops beside the request (the control loop, heartbeats:
`BACKGROUND`, by trio task name) are left out unless --everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PKG = os.path.join(ROOT, "appliance") + os.sep
MODEL = "sim-small"
LISTEN_RE = re.compile(r"appliance (\w+) listening on (https?://\S+)")
# The loops that run beside the request (trio task names): left out unless --everything,
# so that one run counts what the request itself enters -- the control loop woken by the
# request's end, a node's heartbeat, the watchdog, the node's state long-polls.
BACKGROUND = ("Control.run", "supervise", "Liveness", "sdnotify", "announce", "_idle",
              "heartbeat", "ChangeWaiter", "Fence", "watchdog", "_load", "_idle_unload")


# --- the child: one appliance role with the profile hook ---------------------------------


def child(role: str, out: str, everything: bool) -> int:
    import trio

    seen: dict[tuple[str, int, str], int] = {}
    order: list[tuple[str, int, str]] = []
    current_task = trio.lowlevel.current_task

    def hook(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's signature
        if event != "call":
            return
        code = frame.f_code
        fn = code.co_filename
        if not fn.startswith(PKG):
            return
        if not everything:
            try:
                task = current_task().name
            except RuntimeError:
                task = ""
            if any(b in task for b in BACKGROUND):
                return
        key = (fn[len(PKG):], code.co_firstlineno, code.co_qualname)
        n = seen.get(key)
        if n is None:
            order.append(key)
            seen[key] = 1
        else:
            seen[key] = n + 1

    def start(*_: object) -> None:
        seen.clear()
        order.clear()
        sys.setprofile(hook)

    def stop(*_: object) -> None:
        sys.setprofile(None)
        with open(out, "w") as f:
            json.dump([[*k, seen[k]] for k in order], f)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.path.insert(0, ROOT)
    from appliance.cli import main

    return main([role])


# --- the driver ------------------------------------------------------------------------


class Proc:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        full = {k: v for k, v in os.environ.items() if "__" not in k}
        full.update(env, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(args, env=full, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, start_new_session=True, cwd=ROOT)
        self.url = ""
        self.lines: list[str] = []
        self._got = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stderr is not None
        for raw in self.popen.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            m = LISTEN_RE.search(line)
            if m and not self.url and m.group(1) in ("sim", "node", "hub"):
                self.url = m.group(2)
                self._got.set()
        self._got.set()

    def wait_url(self, timeout: float = 60.0) -> str:
        if not self._got.wait(timeout) or not self.url:
            raise SystemExit("no listening line; stderr:\n" + "\n".join(self.lines[-20:]))
        return self.url

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def chat(url: str, stream: bool = True) -> int:
    """One chat completion on a fresh connection; the number of SSE events read."""
    import httpx

    body = {"model": MODEL, "stream": stream, "max_tokens": 8,
            "messages": [{"role": "user", "content": "walk the request path " * 80}]}
    events = 0
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions",
                                                 json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            events += line.startswith("data:")
    return events


def summary(rows: list[list]) -> tuple[int, int, int]:
    return len({r[0] for r in rows}), len(rows), sum(r[3] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--list", choices=("hub", "node", "all"), help="print the functions")
    ap.add_argument("--json", help="write every process's rows here")
    ap.add_argument("--everything", action="store_true",
                    help="count the background loops too (see BACKGROUND)")
    args = ap.parse_args()
    if args.child:
        sys.exit(child(args.child, args.out, args.everything))

    tmp = tempfile.mkdtemp(prefix="walk-")
    me = [sys.executable, os.path.abspath(__file__)]
    procs: list[Proc] = []
    try:
        sim = Proc([sys.executable, "-m", "appliance", "sim"],
                   {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": "1000"})
        procs.append(sim)
        extra = ["--everything"] if args.everything else []
        node = Proc([*me, "--child", "node", "--out", os.path.join(tmp, "node.json"), *extra],
                    {"Node__Name": "walk", "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                     "Engine__Kind": "openai", "Engine__Url": sim.wait_url()})
        procs.append(node)
        hub = Proc([*me, "--child", "hub", "--out", os.path.join(tmp, "hub.json"), *extra],
                   {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Audit__Path": os.devnull,
                    "Store__Path": "",  # no store: never the machine's /var/lib/appliance
                    "Hub__Workers": "1", "Router__Affinity": "on",
                    "Nodes__0__Name": "walk", "Nodes__0__Url": node.wait_url()})
        procs.append(hub)
        url = hub.wait_url()
        deadline = time.monotonic() + 60
        while True:
            try:
                chat(url)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        chat(url)
        for p in (hub, node):
            p.popen.send_signal(signal.SIGUSR1)
        time.sleep(0.2)
        events = chat(url)
        time.sleep(0.2)
        for p in (hub, node):
            p.popen.send_signal(signal.SIGUSR2)
        rows: dict[str, list[list]] = {}
        for role in ("hub", "node"):
            path = os.path.join(tmp, f"{role}.json")
            for _ in range(100):
                if os.path.exists(path) and os.path.getsize(path):
                    break
                time.sleep(0.05)
            with open(path) as f:
                rows[role] = json.load(f)
    finally:
        for p in reversed(procs):
            p.stop()

    print(f"one streamed chat completion ({events} SSE events), plain TCP, Hub__Workers=1, "
          "model ready, affinity on")
    print("| process | files | distinct functions | calls |")
    print("| --- | --- | --- | --- |")
    for role in ("hub", "node"):
        files, funcs, calls = summary(rows[role])
        print(f"| {role} | {files} | {funcs} | {calls} |")
    if args.list:
        for role in ("hub", "node") if args.list == "all" else (args.list,):
            print(f"\n{role}:")
            by: dict[str, list[str]] = {}
            for path, _line, name, n in rows[role]:
                by.setdefault(path, []).append(name if n == 1 else f"{name} x{n}")
            for path, names in by.items():
                print(f"  {path}: {', '.join(names)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
