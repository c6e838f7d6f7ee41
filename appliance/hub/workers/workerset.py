"""The main process's hub workers (`Hub__Workers=N>1`): started, watched, restarted, counted.

Theory of operation: one slot per worker (labels "1".."N-1", bounded by Hub__Workers <= 8)
and one small trio task per slot: start the process, wait for it to exit, and -- unless the
hub is stopping -- log it, count it and start it again after a backoff. The decisions are
plain functions (`next_failures`, `restart_delay`): a worker that dies within
STABLE_SECONDS of its start doubles the next delay (0.5 s .. BACKOFF_MAX); one that ran
longer is restarted after BACKOFF_START. A worker's open leases are given back by the main
as their connections drop (hub/workers.py), whatever killed it. SIGHUP is passed on
(`signal`), so each worker re-reads the configuration the main just reloaded. `stop`
SIGTERMs them (they stop accepting and drain), waits, and kills what is left.

Whole-hub numbers: `collect` is a Prometheus collector (the workers' count, alive,
restarts, the hub's CPU -- the main, its live workers and the reaped ones -- and each
process's CPU and resident memory with a bounded `worker` label); `status` is the
`workers` block of /api/status.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
# A worker that ran this long before it died is not crash-looping: the backoff starts over.
STABLE_SECONDS = 30.0
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def next_failures(failures: int, ran_seconds: float) -> int:
    """Consecutive quick deaths after one more exit, the process having run `ran_seconds`."""
    return 1 if ran_seconds >= STABLE_SECONDS else failures + 1


def restart_delay(failures: int) -> float:
    """How long to wait before starting a worker again after `failures` quick deaths."""
    # The exponent capped: 0.5 * 2 ** 1025 is an OverflowError (8.5 hours of crash loops).
    return min(BACKOFF_START * 2.0 ** min(max(0, failures - 1), 64), BACKOFF_MAX)


def read_proc(pid: int | str) -> tuple[float, float, int]:
    """(own CPU seconds, reaped children's CPU seconds, resident bytes) from /proc/PID/stat;
    zeros for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0, 0.0, 0
    # after the name: state(0) ... utime(11) stime(12) cutime(13) cstime(14) ... rss(21)
    own = (int(fields[11]) + int(fields[12])) / _TICK
    children = (int(fields[13]) + int(fields[14])) / _TICK
    return own, children, int(fields[21]) * _PAGE


class Proc(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Slot:
    label: str
    proc: Proc | None = None
    started: float = 0.0
    failures: int = 0
    restarts: int = 0
    exits: list[int] = field(default_factory=list)  # return codes, the last few

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class WorkerSet:
    """N-1 workers kept running by the main process; `start()` makes one process."""

    def __init__(self, n: int, start: Callable[[], Awaitable[Proc]]) -> None:
        self.slots = [Slot(str(i)) for i in range(1, n)]
        self._start = start
        self.stopping = False
        self.restarts = 0
        self.changed = trio.Event()  # set (and replaced) whenever a worker starts or exits

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for slot in self.slots:
                await self._spawn(slot)
            task_status.started()
            for slot in self.slots:
                nursery.start_soon(self._keep, slot)

    async def _spawn(self, slot: Slot) -> None:
        slot.proc = await self._start()
        slot.started = trio.current_time()
        self._changed()

    async def _keep(self, slot: Slot) -> None:
        while True:
            assert slot.proc is not None
            code = await slot.proc.wait()
            self._changed()
            if self.stopping:
                return
            ran = trio.current_time() - slot.started
            slot.failures = next_failures(slot.failures, ran)
            slot.exits = [*slot.exits[-4:], code]
            delay = restart_delay(slot.failures)
            log.error("hub worker %s (pid %d) exited with %s after %.1f s; restarting it in %.1f s "
                      "(its open requests were given back)", slot.label, slot.proc.pid, code, ran,
                      delay)
            await trio.sleep(delay)
            if self.stopping:
                return
            await self._spawn(slot)
            slot.restarts += 1
            self.restarts += 1
            log.warning("hub worker %s restarted (pid %d)", slot.label, slot.proc.pid)

    def live(self) -> Iterator[Proc]:
        for slot in self.slots:
            if slot.alive:
                assert slot.proc is not None
                yield slot.proc

    def signal(self, sig: int) -> None:
        for p in self.live():
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass

    def reload(self) -> None:
        """The main reloaded its configuration: each worker re-reads it (SIGHUP)."""
        self.signal(signal.SIGHUP)

    def drain(self) -> None:
        """Stop: no more restarts; the workers stop accepting and drain (SIGTERM)."""
        self.stopping = True
        self.signal(signal.SIGTERM)

    async def stop(self, seconds: float) -> None:
        """Drain, wait up to `seconds` for the workers to exit, kill what is left."""
        self.drain()
        with trio.move_on_after(seconds):
            while any(True for _ in self.live()):
                await self.changed.wait()
        for slot in self.slots:
            if slot.alive:
                assert slot.proc is not None
                log.error("hub worker %s (pid %d) did not exit after its drain: killed",
                          slot.label, slot.proc.pid)
                slot.proc.kill()
                with trio.move_on_after(5):
                    await slot.proc.wait()

    # --- whole-hub numbers ------------------------------------------------------------------

    def processes(self) -> list[dict[str, Any]]:
        own, _, rss = read_proc("self")
        out: list[dict[str, Any]] = [{"worker": "main", "pid": os.getpid(), "alive": True,
                                      "cpu_seconds": own, "resident_bytes": rss, "restarts": 0}]
        for slot in self.slots:
            cpu, rss = 0.0, 0
            if slot.alive:
                assert slot.proc is not None
                cpu, _, rss = read_proc(slot.proc.pid)
            out.append({"worker": slot.label, "pid": slot.proc.pid if slot.proc else 0,
                        "alive": slot.alive, "cpu_seconds": cpu, "resident_bytes": rss,
                        "restarts": slot.restarts})
        return out

    def cpu_seconds(self, procs: list[dict[str, Any]] | None = None) -> float:
        """The whole hub's CPU: the main, its live workers and the workers it reaped."""
        procs = procs if procs is not None else self.processes()
        _, reaped, _ = read_proc("self")
        cpu: float = sum(p["cpu_seconds"] for p in procs) + reaped
        return cpu

    def status(self) -> dict[str, Any]:
        procs = self.processes()
        return {"configured": len(self.slots) + 1, "alive": sum(1 for p in procs if p["alive"]),
                "restarts": self.restarts, "cpu_seconds": round(self.cpu_seconds(procs), 2),
                "processes": [{**p, "cpu_seconds": round(p["cpu_seconds"], 2)} for p in procs]}

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        procs = self.processes()
        yield _gauge("appliance_hub_workers", "Processes serving Hub__Listen (Hub__Workers).",
                     len(self.slots) + 1)
        yield _gauge("appliance_hub_workers_alive", "Of them, running now (the main counts).",
                     sum(1 for p in procs if p["alive"]))
        c = CounterMetricFamily("appliance_hub_worker_restarts_total",  # (family: no _total)
                                "Hub workers restarted after they exited.")
        c.add_metric([], self.restarts)
        yield c
        c = CounterMetricFamily("appliance_hub_cpu_seconds_total",
                                "CPU of the whole hub: the main process and its workers.")
        c.add_metric([], self.cpu_seconds(procs))
        yield c
        cpu = GaugeMetricFamily("appliance_hub_worker_cpu_seconds",
                                "CPU of each hub process since it started.", labels=["worker"])
        rss = GaugeMetricFamily("appliance_hub_worker_resident_bytes",
                                "Resident memory of each hub process.", labels=["worker"])
        for p in procs:
            if p["alive"]:
                cpu.add_metric([p["worker"]], p["cpu_seconds"])
                rss.add_metric([p["worker"]], p["resident_bytes"])
        yield cpu
        yield rss


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
