"""Batches on the fleet: throughput, the essential client beside a batch, kill -9, store cost.

Two sim nodes (`Node__MaxConcurrency` places each, the sim streaming `--tps` tokens a
second), priority on (reserve 1), one hub with a store. Rounds, one run, side by side:
  1. capacity: a plain client keeps every place busy with the batch's own request; its
     requests/s is the fleet's rate for these lines (the "spare places" measured alone).
  2. essential alone: a client of class essential (a process of its own) sends streamed
     chats back to back for `--seconds`; its TTFT p50/p95.
  3. batch alone: a `--lines`-line chat batch (`Batch__MaxConcurrent` = every place): lines/s.
  4. batch + essential: both at once; the essential client's TTFT and the batch's lines/s;
     then the essential client alone again (the box's load drifts): p95 beside over the
     mean of both alone rounds.
  5. kill -9 at 50%: the hub is killed mid-batch and started again on the same store; the
     batch completes; output lines, distinct custom_ids, lines run twice (audit lines of
     the batch with status 200, less the line count).
  6. store cost: non-streamed Responses requests with `store` left on (the default) and
     with `store: false`, in `--store-rounds` blocks of `--responses` each, interleaved;
     the hub's CPU per request for each (its loop, and the store's thread), and the ratio.

    .venv/bin/python bench/batch.py --lines 2000
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time

import httpx
import openai

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "harness"))
from procfs import loop_and_rest, thread_cpu  # noqa: E402
from procs import Procs, wait_until  # noqa: E402

ESSENTIAL, OWNER, ADMIN = "ke", "kb", "adm"
TOKENS = 8


def body(i: int) -> dict:
    return {"model": "m", "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": f"summarise ticket {i}"}]}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.procs, self.tmp = args, Procs(), tempfile.mkdtemp(prefix="batch-")
        self.places = 2 * args.places
        nodes = [self.procs.node(f"n{i}", {"Sim__Models__0__Name": "m",
                                          "Sim__TokensPerSecond": str(args.tps),
                                          "Sim__Parallel": str(args.places),
                                          "Node__MaxConcurrency": str(args.places),
                                          "Node__ModelSlots": str(args.places)})
                 for i in (1, 2)]
        self.env = {"Store__Path": os.path.join(self.tmp, "store", "store.db"),
                    "Audit__Path": os.path.join(self.tmp, "audit.jsonl"),
                    "Priority__Enabled": "true", "Batch__MaxConcurrent": str(self.places),
                    "Auth__AdminKey": ADMIN, "Auth__RequireKeys": "true",
                    "Auth__Clients__0__Name": "essential", "Auth__Clients__0__Key": ESSENTIAL,
                    "Auth__Clients__0__Priority": "essential",
                    "Auth__Clients__1__Name": "bulk", "Auth__Clients__1__Key": OWNER,
                    "Models__0__Name": "m", "Models__0__Replicas": "2",
                    **{f"Nodes__{i}__{k}": v for i, n in enumerate(nodes)
                       for k, v in (("Name", f"n{i + 1}"), ("Url", n.url))}}
        self.start_hub()

    def start_hub(self) -> None:
        self.hub = self.procs.hub(self.env, metrics=False)
        wait_until(lambda: any(m["name"] == "m" and m["ready"] == 2 for m in httpx.get(
            self.hub.url + "/api/status", headers={"authorization": f"Bearer {ADMIN}"},
            timeout=10).json()["models"]), timeout=60, what="the model ready on both nodes")
        self.oai = openai.OpenAI(base_url=self.hub.url + "/v1", api_key=OWNER, max_retries=0)

    def capacity(self, seconds: float) -> float:
        stop, done = threading.Event(), [0]

        def worker() -> None:
            with httpx.Client(timeout=60, headers={"authorization": f"Bearer {OWNER}"}) as c:
                i = 0
                while not stop.is_set():
                    if c.post(self.hub.url + "/v1/chat/completions",
                              json=body(i)).status_code == 200:
                        done[0] += 1
                    i += 1

        threads = [threading.Thread(target=worker) for _ in range(self.places)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        return done[0] / (time.monotonic() - t0)

    def essential(self, seconds: float | None = None) -> Essential:
        """The essential client, in a process of its own (so this process's polling never
        slows its reads): for `seconds`, or until `.stop()`."""
        return Essential(self.hub.url, seconds)

    def submit(self, n: int) -> str:
        text = "\n".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                     "url": "/v1/chat/completions", "body": body(i)})
                         for i in range(n))
        f = self.oai.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
        return self.oai.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                       completion_window="24h").id

    def wait(self, bid: str, until: float = 1.0, poll: float = 0.1) -> object:
        def check():
            b = self.oai.batches.retrieve(bid)
            c = b.request_counts
            return b if (b.status == "completed" if until >= 1.0 else
                         c.total and c.completed >= until * c.total) else None
        return wait_until(check, timeout=3600, interval=poll, what=f"batch at {until:.0%}")

    def batch_rate(self, n: int, poll: float = 0.1) -> tuple[float, object]:
        t0 = time.monotonic()
        bid = self.submit(n)
        b = self.wait(bid, poll=poll)
        return n / (time.monotonic() - t0), b

    def audit(self) -> list[dict]:
        with open(self.env["Audit__Path"]) as f:
            return [json.loads(x) for x in f]


def _chat_loop(url: str, seconds: float | None, stop: object, out: object) -> None:
    c = openai.OpenAI(base_url=url + "/v1", api_key=ESSENTIAL, max_retries=0)
    ttfts, i = [], 0
    end = time.monotonic() + seconds if seconds is not None else float("inf")
    while not stop.is_set() and time.monotonic() < end:
        t0 = time.perf_counter()
        st = c.chat.completions.create(stream=True, **body(i))
        for chunk in st:
            if chunk.choices and chunk.choices[0].delta.content:
                ttfts.append(time.perf_counter() - t0)
                break
        for _ in st:
            pass
        i += 1
    out.send(ttfts)


class Essential:
    """Streamed chats of class essential back to back, in a child process; `.ttfts()`."""

    def __init__(self, url: str, seconds: float | None) -> None:
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_chat_loop, args=(url, seconds, self._stop, send))
        self._proc.start()

    def ttfts(self) -> list[float]:
        self._stop.set()
        got = self._recv.recv()
        self._proc.join()
        return got


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2000)
    ap.add_argument("--places", type=int, default=4, help="places per node")
    ap.add_argument("--tps", type=int, default=200, help="sim tokens per second")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--responses", type=int, default=100, help="requests per store block")
    ap.add_argument("--store-rounds", type=int, default=10, help="store blocks of each mode")
    ap.add_argument("--rounds", default="1,2,3,4,5,6", help="which rounds (4 needs 1-3)")
    args = ap.parse_args()
    rounds = {int(r) for r in args.rounds.split(",")}
    b = Bench(args)
    try:
        if 1 in rounds:
            rounds_1_to_4(b, args)
        if 5 in rounds:
            kill_round(b, args)
        if 6 in rounds:
            store_round(b, args)
    finally:
        b.procs.close()


def rounds_1_to_4(b: Bench, args: argparse.Namespace) -> None:
    cap = b.capacity(args.seconds)
    print(f"1. capacity: {cap:.1f} requests/s on {b.places} places", flush=True)
    e = b.essential(args.seconds)
    time.sleep(args.seconds)
    alone = e.ttfts()
    print(f"2. essential alone: {len(alone)} chats, TTFT p50 {pct(alone, .5):.1f} ms, "
          f"p95 {pct(alone, .95):.1f} ms", flush=True)
    time.sleep(2)  # the essential client's last chats out of the hub's view (beside.py)
    rate, _ = b.batch_rate(args.lines)
    print(f"3. batch alone: {args.lines} lines, {rate:.1f} lines/s "
          f"({100 * rate / cap:.0f}% of capacity)", flush=True)
    e = b.essential()
    rate2, _ = b.batch_rate(args.lines, poll=1.0)
    beside = e.ttfts()
    e = b.essential(args.seconds)  # alone again: the box's load drifts over a run
    time.sleep(args.seconds)
    after = e.ttfts()
    base = (pct(alone, .95) + pct(after, .95)) / 2
    print(f"4. batch + essential: {rate2:.1f} lines/s; essential {len(beside)} chats, TTFT "
          f"p50 {pct(beside, .5):.1f} ms, p95 {pct(beside, .95):.1f} ms; alone again after: "
          f"p50 {pct(after, .5):.1f} ms, p95 {pct(after, .95):.1f} ms; p95 beside / alone "
          f"(both alone rounds' mean) {pct(beside, .95) / base:.2f}x", flush=True)


def kill_round(b: Bench, args: argparse.Namespace) -> None:
    bid = b.submit(args.lines)
    b.wait(bid, 0.5)
    b.hub.kill()
    b.start_hub()
    done = b.wait(bid)
    out = [json.loads(x) for x in b.oai.files.content(done.output_file_id).text.splitlines()]
    ran = sum(1 for a in b.audit() if a.get("batch") == bid and a.get("status") == 200)
    print(f"5. kill -9 at 50%: {done.status}, {len(out)} output lines, "
          f"{len({o['custom_id'] for o in out})} distinct custom_ids, "
          f"{ran - args.lines} lines run twice (Batch__MaxConcurrent={b.places})", flush=True)


def store_round(b: Bench, args: argparse.Namespace) -> None:
    """Store on and off in blocks of `--responses` requests, `--store-rounds` blocks each,
    in the order on off off on on off ... (the machine's load drifts over a run: this
    order leaves a steady drift out of the difference); the hub's CPU split into its loop
    (the main thread) and the rest (the store's thread: SQLite); the totals' ratio."""
    c = openai.OpenAI(base_url=b.hub.url + "/v1", api_key=OWNER, max_retries=0)
    for store in (True, False):
        c.responses.create(model="m", input="warm", max_output_tokens=4, store=store)
    cpu: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
    for r in range(2 * args.store_rounds):
        store = r % 4 in (0, 3)
        cpu0 = thread_cpu(b.hub.pid)
        for i in range(args.responses):
            c.responses.create(model="m", input=f"question {i}", max_output_tokens=4,
                               store=store)
        loop, rest = loop_and_rest(b.hub.pid, cpu0)
        cpu[store][0] += loop
        cpu[store][1] += rest
    n = args.responses * args.store_rounds
    for store in (True, False):
        loop, rest = (x / n * 1000 for x in cpu[store])
        print(f"6. responses, store {'on ' if store else 'off'}: {loop + rest:.3f} ms hub CPU "
              f"per request ({loop:.3f} loop + {rest:.3f} other threads; {n} requests)",
              flush=True)
    on, off = sum(cpu[True]), sum(cpu[False])
    print(f"6. store cost: {100 * (on / off - 1):+.1f}% hub CPU with store on", flush=True)

if __name__ == "__main__":
    main()
