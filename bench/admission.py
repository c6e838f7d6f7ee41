"""Benchmark: the admission decision and the memory of a waiting request (issue 3).

Targets: one request's admission decision with 100 nodes and 10,000 waiters under 50 us;
memory per waiting request under 8 KiB.

The fleet: 100 real NodeHandles, each with 5 models ready, in a real Registry, and a real
`Admission` (priority on, ReserveSlots=1) with 10,000 background requests held as trio
tasks, because exactly one place is free. In the worst case that place is on the last
node, so an essential request's decision walks all 100 nodes; with room to spare it
stops at the first node that has some.

Run: .venv/bin/python bench/admission.py
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import trio
import trio.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from appliance import config  # noqa: E402
from appliance.hub.decide.admission import Admission  # noqa: E402
from appliance.hub.decide.priority import count, fleet_of  # noqa: E402
from appliance.hub.fleet.nodes import NodeHandle, Registry  # noqa: E402
from appliance.wire import ModelState, NodeState  # noqa: E402

NODES = 100
WAITERS = 10_000
MODEL = "llama3:8b"
OTHER_MODELS = ["qwen2.5:0.5b", "mistral:7b", "phi3:mini", "gemma2:9b"]


def fleet(cap: int) -> Registry:
    """100 nodes, `Node__ModelSlots=2`, `Node__MaxConcurrency=cap`; every node runs two
    requests of the model except the last, which runs one: one place free in all, at the
    far end of the walk."""
    r = Registry()
    for i in range(NODES):
        h = NodeHandle(f"gpu-{i:03d}", f"http://gpu-{i:03d}:9090", static=False)
        h.connected = True
        h.state = NodeState(name=h.name, slots=2, max_concurrency=cap,
                            models=[ModelState(name=m, state="ready") for m in [*OTHER_MODELS,
                                                                                MODEL]])
        r.nodes[h.name] = h
    for h in list(r.nodes.values()):
        r.start(h, MODEL)
        if h.name != f"gpu-{NODES - 1:03d}":
            r.start(h, MODEL)
    return r


def cfg() -> config.Config:
    return config.load({"Priority__Enabled": "true", "Priority__ReserveSlots": "1",
                        "Queue__MaxDepth": str(WAITERS * 2)})


def per_call_us(fn, n: int = 2000, rounds: int = 7) -> float:
    """Median microseconds per call over `rounds` rounds of `n` calls."""
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter_ns() - t0) / n / 1000)
    return statistics.median(samples)


async def held_request(adm: Admission, r: Registry, client: str) -> None:
    """What the router does with a held background request: admit, pick, start, run."""
    await adm.admit(MODEL, "background", client)
    r.start(r.pick(MODEL), MODEL)
    await trio.sleep_forever()


async def hold_waiters(adm: Admission, r: Registry, nursery: trio.Nursery,
                       n: int = WAITERS) -> None:
    for i in range(n):
        nursery.start_soon(held_request, adm, r, f"batch-{i:05d}")
    await trio.testing.wait_all_tasks_blocked()


async def bench_decisions(cap: int, what: str) -> None:
    r = fleet(cap)
    adm = Admission(cfg(), r, None)
    core = adm.core
    async with trio.open_nursery() as nursery:
        await hold_waiters(adm, r, nursery)
        assert core.classes["background"].waiting == WAITERS
        print(
            f"{what}: {NODES} nodes (MaxConcurrency={cap}, ModelSlots=2), {WAITERS:,} background "
            "requests held")

        def decide(cls: str):
            ready = adm._ready_nodes(MODEL)
            return core.arrive(MODEL, cls, "client", lambda p, q: count(ready, MODEL, p, q))

        def essential_goes():
            assert decide("essential") is None

        def background_queues():
            core.leave(decide("background"), timed_out=False)

        rows = [
            ("the full walk: fleet_of (reference), 100 nodes", lambda: fleet_of(r.nodes.values(),
                                                                                MODEL)),
            ("the full walk: count over the ready nodes", lambda: count(adm._ready_nodes(MODEL),
                                                                        MODEL)),
            ("essential arrives and goes: the decision", essential_goes),
            ("background arrives, queues behind 10,000 (+ leave)", background_queues),
        ]
        for name, fn in rows:
            print(f"  {name:<56} {per_call_us(fn):7.2f} us")

        n = 2000
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await adm.admit(MODEL, "essential", "ops")
            rounds.append((time.perf_counter_ns() - t0) / n / 1000)
        print(
            f"  {'await Admission.admit, essential goes at once':<56} "
            f"{statistics.median(rounds):7.2f} us")

        # A request finishes: the registry's listener (shape check, dispatch) grants the
        # head of the 10,000 its place; its task then starts, and one more is held.
        samples = []
        nodes = list(r.nodes.values())
        for i in range(500):
            h = nodes[i % NODES]
            t0 = time.perf_counter_ns()
            r.finish(h, MODEL)
            samples.append((time.perf_counter_ns() - t0) / 1000)
            await hold_waiters(adm, r, nursery, 1)
        assert core.classes["background"].released == 500
        print(
            f"  {'a request finishes: the listener wakes the next waiter':<56} "
            f"{statistics.median(samples):7.2f} us")
        nursery.cancel_scope.cancel()


def bench_memory() -> None:
    """Bytes per waiting request: the core's part, and the whole waiting trio task."""

    async def main():
        r = fleet(2)
        adm = Admission(cfg(), r, None)
        async with trio.open_nursery() as nursery:
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            tracemalloc.start(1)
            t0 = tracemalloc.get_traced_memory()[0]
            await hold_waiters(adm, r, nursery)
            t1 = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            print(
                f"memory: {WAITERS:,} requests held, each a trio task (task, coroutine frames, "
                "cancel scope,"
                  f" Event, Waiter, queue entry): {(t1 - t0) / WAITERS:,.0f} B per waiting request")
            nursery.cancel_scope.cancel()

    trio.run(main)


if __name__ == "__main__":
    trio.run(bench_decisions, 2, "worst case: the one free place is on the last node")
    trio.run(bench_decisions, 4, "room to spare: every node has concurrency left")
    bench_memory()
