"""The main process's lease handler (hub/workers.py `_lease`) against a fake worker, in
process, under trio's MockClock: the real Hub objects (registry, admission, control, audit)
and in-memory streams, no sockets. A dropped worker connection while queued, while the
model loads and while relaying gives the place back and writes one audit line; `Cut`
reaches the worker when its node is lost and when the drain runs out; and the worker
set's restart decisions (backoff) and its shell (a fake process) restart a dead worker.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest

from appliance.config import load
from appliance.hub.hub import Hub
from appliance.hub.translate.usage import Usage
from appliance.hub.workers import workerset
from appliance.hub.workers.lease import Ack, Answer, Ask, Conn, Cut, Done, Go, Left
from appliance.hub.workers.pool import _lease
from appliance.wire import ModelState, NodeState

MODEL = "m"


def body(**extra) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       **extra}).encode()


class FakeWorker:
    """One lease, as a worker holds it: the main's side runs `_lease` on the other end."""

    def __init__(self, hub: Hub, nursery: trio.Nursery, rid: str) -> None:
        mine, theirs = trio.testing.memory_stream_pair()
        self.stream = mine
        self.conn = Conn(mine, 1 << 20)
        self.rid = rid
        self.handler_done = trio.Event()

        async def main_side() -> None:
            try:
                await _lease(hub, theirs)
            finally:
                self.handler_done.set()

        nursery.start_soon(main_side)

    async def ask(self, rid: str = "", seq: int = 0) -> None:
        await self.conn.send(Ask("/v1/chat/completions", "openai",
                                 [(b"x-request-id", (rid or self.rid).encode())], body(), "",
                                 seq))

    async def go(self, rid: str = "", seq: int = 0) -> Go:
        """Ask, and be told Go."""
        await self.ask(rid, seq)
        go = await self.conn.recv()
        assert isinstance(go, Go), go
        return go

    async def drop(self) -> None:
        """The worker died: its connection just ends."""
        await self.stream.aclose()
        with trio.fail_after(5):
            await self.handler_done.wait()

    async def leave(self) -> None:
        """The worker's client went away: the worker says so (`Left`), then ends the lease."""
        await self.conn.send(Left())
        await self.drop()


async def make_hub(nursery: trio.Nursery, tmp_path, state: str = "ready") -> Hub:
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Audit__Path": str(tmp_path / "audit.jsonl")})
    hub = Hub(cfg, nursery)
    h, _ = hub.registry.upsert("a", "http://127.0.0.1:1", static=True)
    h.connected = True
    h.state = NodeState(name="a", max_concurrency=1, slots=1,
                        models=[ModelState(name=MODEL, state=state)])  # type: ignore[arg-type]
    hub.registry.changed()
    return hub


def audit_lines(tmp_path, rid: str) -> list[dict]:
    path = tmp_path / "audit.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [x for x in lines if x.get("request_id") == rid]


async def settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_dropped_while_relaying_gives_the_place_back_once(autojump_clock, tmp_path):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        node = hub.registry.nodes["a"]
        w = FakeWorker(hub, nursery, "relaying")
        go = await w.go()
        assert go.node == "a" and go.model == MODEL
        assert node.in_flight_total == 1
        await trio.sleep(3)  # relaying for a while
        await w.drop()  # the worker died holding the client
        assert node.in_flight_total == 0
        [line] = audit_lines(tmp_path, "relaying")
        assert line["error"] == "worker_lost" and line["node"] == "a"
        nursery.cancel_scope.cancel()


async def test_dropped_while_queued_leaves_the_queue(autojump_clock, tmp_path):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        node = hub.registry.nodes["a"]
        first = FakeWorker(hub, nursery, "first")
        await first.go()
        queued = FakeWorker(hub, nursery, "queued")
        await queued.ask()
        await settle()
        await trio.sleep(5)  # waiting, under Queue__MaxWaitSeconds
        assert hub.admission.core.models[MODEL].waiting == 1 and node.in_flight_total == 1
        await queued.leave()  # the client went away while it waited
        assert hub.admission.core.models[MODEL].waiting == 0
        [line] = audit_lines(tmp_path, "queued")
        assert line["status"] == 499 and line["error"] == "client_disconnected"
        dead = FakeWorker(hub, nursery, "dead")
        await dead.ask()
        await settle()
        await trio.sleep(2)
        assert hub.admission.core.models[MODEL].waiting == 1
        await dead.drop()  # the worker holding it died while it waited
        assert hub.admission.core.models[MODEL].waiting == 0
        [line] = audit_lines(tmp_path, "dead")
        assert line["status"] == 502 and line["error"] == "worker_lost"
        # The first ends normally; the place is free for the next one at once.
        await first.conn.send(Done("a", 200, 0.01, ""))
        assert isinstance(await first.conn.recv(), Ack)
        await first.drop()
        assert node.in_flight_total == 0
        assert [x["status"] for x in audit_lines(tmp_path, "first")] == [200]
        nxt = FakeWorker(hub, nursery, "next")
        with trio.fail_after(1):
            await nxt.go()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("end, status, error", [("leave", 499, "client_disconnected"),
                                                ("drop", 502, "worker_lost")])
async def test_dropped_while_loading_writes_one_line_and_holds_nothing(autojump_clock, tmp_path,
                                                                      end, status, error):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path, state="loading")
        node = hub.registry.nodes["a"]
        w = FakeWorker(hub, nursery, "loading")
        await w.ask()
        await settle()
        await trio.sleep(10)  # the activation waits (Router__ActivationWaitSeconds: 45)
        assert node.in_flight_total == 0 and not w.handler_done.is_set()
        await getattr(w, end)()
        [line] = audit_lines(tmp_path, "loading")
        assert line["status"] == status and line["error"] == error
        assert node.in_flight_total == 0
        nursery.cancel_scope.cancel()


async def test_loading_too_long_is_answered_model_loading(autojump_clock, tmp_path):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path, state="loading")
        w = FakeWorker(hub, nursery, "slow-load")
        await w.ask()
        answer = await w.conn.recv()  # after the activation wait, on the mock clock
        assert isinstance(answer, Answer) and answer.status == 503
        assert json.loads(answer.body)["error"]["code"] == "model_loading"
        await w.drop()
        assert [x["error"] for x in audit_lines(tmp_path, "slow-load")] == ["model_loading"]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("how", ["node_lost", "shutting_down"])
async def test_cut_reaches_the_worker(autojump_clock, tmp_path, how):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        node = hub.registry.nodes["a"]
        w = FakeWorker(hub, nursery, how)
        await w.go()
        await trio.sleep(2)
        if how == "node_lost":
            hub.registry.mark_lost(node, "watch stream ended")
        else:
            hub.drain_over.set()
        cut = await w.conn.recv()
        assert isinstance(cut, Cut) and cut.reason == how
        if how == "node_lost":
            assert cut.lost_reason == "watch stream ended"
        # The worker ends its stream with the error event and reports.
        await w.conn.send(Done("a", 200, 0.01, how))
        assert isinstance(await w.conn.recv(), Ack)
        await w.drop()
        assert node.in_flight_total == 0
        [line] = audit_lines(tmp_path, how)
        assert line["error"] == how
        nursery.cancel_scope.cancel()


async def test_a_connection_carries_one_lease_after_another(autojump_clock, tmp_path):
    """A worker keeps its connection: the next `Ask` is the next lease; a `Cut` names its
    lease (`seq`), so a late one is not taken for the next lease's."""
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        node = hub.registry.nodes["a"]
        w = FakeWorker(hub, nursery, "")
        for seq, rid in enumerate(("first", "second"), 1):
            await w.go(rid, seq)
            assert node.in_flight_total == 1
            if rid == "second":
                hub.registry.mark_lost(node, "watch stream ended")
                cut = await w.conn.recv()
                assert isinstance(cut, Cut) and cut.seq == 2
            await w.conn.send(Done("a", 200, 0.01, ""))
            assert isinstance(await w.conn.recv(), Ack)
            await settle()
            assert node.in_flight_total == 0 and not w.handler_done.is_set()
        await w.drop()
        for rid in ("first", "second"):
            assert [x["status"] for x in audit_lines(tmp_path, rid)] == [200]
        nursery.cancel_scope.cancel()


async def test_the_workers_usage_reaches_the_main_processs_record(autojump_clock, tmp_path):
    """The worker read the answer's usage; `Done` carries it to the main process, whose
    audit line and key's lease count it (counted by the hub: marked estimated)."""
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        w = FakeWorker(hub, nursery, "")
        for seq, (rid, usage) in enumerate((("said", Usage(12, 5, 8)),
                                            ("counted", Usage(9, 4, 0, estimated=True))), 1):
            await w.go(rid, seq)
            await w.conn.send(Done("a", 200, 0.01, "", usage))
            assert isinstance(await w.conn.recv(), Ack)
        await w.drop()
        (said,) = audit_lines(tmp_path, "said")
        (counted,) = audit_lines(tmp_path, "counted")
        assert (said["input_tokens"], said["output_tokens"], said["cached_tokens"]) == (12, 5, 8)
        assert "tokens_estimated" not in said
        assert (counted["output_tokens"], counted["tokens_estimated"]) == (4, True)
        nursery.cancel_scope.cancel()


async def test_a_body_the_worker_found_too_large_is_answered_413(autojump_clock, tmp_path):
    async with trio.open_nursery() as nursery:
        hub = await make_hub(nursery, tmp_path)
        w = FakeWorker(hub, nursery, "big")
        await w.conn.send(Ask("/v1/chat/completions", "openai", [(b"x-request-id", b"big")],
                              b"", "too_large", 1))
        answer = await w.conn.recv()
        assert isinstance(answer, Answer) and answer.status == 413
        assert json.loads(answer.body)["error"]["code"] == "body_too_large"
        await w.go("after", 2)  # the connection carries the next lease
        await w.drop()
        assert [x["status"] for x in audit_lines(tmp_path, "big")] == [413]
        nursery.cancel_scope.cancel()


# --- the worker set: decisions and shell ---------------------------------------------------


def test_backoff_doubles_for_quick_deaths_and_starts_over_after_a_stable_run():
    f = 0
    delays = []
    for _ in range(8):
        f = workerset.next_failures(f, ran_seconds=1.0)
        delays.append(workerset.restart_delay(f))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    f = workerset.next_failures(f, ran_seconds=workerset.STABLE_SECONDS)
    assert f == 1 and workerset.restart_delay(f) == workerset.BACKOFF_START
    # a crash loop of any length keeps the cap (2 ** 1025 overflowed a float)
    assert workerset.restart_delay(5000) == workerset.BACKOFF_MAX


class FakeProc:
    pids = iter(range(1000, 2000))

    def __init__(self) -> None:
        self.pid = next(self.pids)
        self.returncode: int | None = None
        self.exited = trio.Event()
        self.signals: list[int] = []

    async def wait(self) -> int:
        await self.exited.wait()
        assert self.returncode is not None
        return self.returncode

    def die(self, code: int) -> None:
        self.returncode = code
        self.exited.set()

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == 15:
            self.die(0)

    def kill(self) -> None:
        self.die(-9)


async def test_a_dead_worker_is_restarted_with_backoff(autojump_clock):
    started: list[FakeProc] = []

    async def start() -> FakeProc:
        started.append(FakeProc())
        return started[-1]

    ws = workerset.WorkerSet(3, start)
    async with trio.open_nursery() as nursery:
        await nursery.start(ws.run)
        assert len(started) == 2 and ws.status()["alive"] == 3
        t0 = trio.current_time()
        started[0].die(-9)  # at once: a quick death
        while len(started) < 3:
            await ws.changed.wait()
        assert trio.current_time() - t0 == pytest.approx(workerset.BACKOFF_START)
        t1 = trio.current_time()
        started[2].die(1)  # again, quickly: the delay doubles
        while len(started) < 4:
            await ws.changed.wait()
        assert trio.current_time() - t1 == pytest.approx(2 * workerset.BACKOFF_START)
        assert ws.restarts == 2 and [s.restarts for s in ws.slots] == [2, 0]
        assert ws.slots[0].exits == [-9, 1] and ws.slots[0].proc is started[3]
        ws.reload()
        assert started[3].signals == [1] and started[1].signals == [1]
        await ws.stop(5)  # SIGTERM; they exit; none restarted
        assert all(p.returncode == 0 for p in (started[1], started[3]))
        await trio.sleep(60)
        assert len(started) == 4
        nursery.cancel_scope.cancel()


async def test_the_worker_set_says_every_process_in_metrics_and_status(autojump_clock):
    procs = [FakeProc(), FakeProc()]
    it = iter(procs)

    async def start() -> FakeProc:
        return next(it)

    ws = workerset.WorkerSet(3, start)
    registry = CollectorRegistry()
    registry.register(ws)
    async with trio.open_nursery() as nursery:
        await nursery.start(ws.run)
        procs[1].die(1)
        await settle()
        st = ws.status()
        assert (st["configured"], st["alive"]) == (3, 2)
        assert [(p["worker"], p["alive"]) for p in st["processes"]] == [
            ("main", True), ("1", True), ("2", False)]
        text = generate_latest(registry).decode()
        assert "appliance_hub_workers 3.0" in text and "appliance_hub_workers_alive 2.0" in text
        assert "appliance_hub_worker_restarts_total 0.0" in text
        # The fake pids are not processes: their CPU reads 0; the main's is this process's.
        assert 'appliance_hub_worker_cpu_seconds{worker="main"}' in text
        assert 'appliance_hub_worker_cpu_seconds{worker="1"} 0.0' in text
        assert 'worker="2"' not in text  # a dead worker has no series until it is back
        [total] = [ln for ln in text.splitlines()
                   if ln.startswith("appliance_hub_cpu_seconds_total ")]
        assert float(total.split()[1]) > 0
        nursery.cancel_scope.cancel()
