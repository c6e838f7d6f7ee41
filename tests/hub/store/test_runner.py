"""The batch runner with a stand-in router: lines run once each, waits for room are
retried, a refusal marked final is not, a resumed batch runs only its pending lines, and at
most Batch__MaxConcurrent lines are in flight."""

from __future__ import annotations

import json
from typing import NamedTuple

import msgspec
import trio
from prometheus_client import CollectorRegistry

from appliance import config
from appliance.hub.store.beside import Arrivals, Beside
from appliance.hub.store.db import Obj
from appliance.hub.store.runner import Batches
from appliance.hub.store.store import Store, open_store


class Router:
    """Answers by the line's prompt: `ok`, `wait:N` (503 priority_wait_timeout N times, then
    200), `parked` (503 with x-should-retry: false)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.in_flight = self.most = 0

    async def __call__(self, scope, receive, send, api) -> None:
        body = json.loads((await receive())["body"])
        said = body["messages"][0]["content"]
        n = self.calls[said] = self.calls.get(said, 0) + 1
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await trio.sleep(1)
        self.in_flight -= 1
        headers = []
        if said.startswith("wait:") and n <= int(said[5:]):
            status, out = 503, {"error": {"code": "priority_wait_timeout", "message": "w"}}
        elif said == "parked":
            status, out = 503, {"error": {"code": "model_parked", "message": "p"}}
            headers = [(b"x-should-retry", b"false")]
        else:
            status, out = 200, {"id": "x", "choices": [{"message": {"content": said}}]}
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": msgspec.json.encode(out)})


def _rows(prompts: list[str]) -> list[tuple[int, str, str, str | None, str | None]]:
    return [(i, f"c{i}", "pending", json.dumps({"model": "m", "messages": [
        {"role": "user", "content": p}]}), None) for i, p in enumerate(prompts)]


class Ran(NamedTuple):
    router: Router
    states: dict[str, int]  # the lines' states, counted
    batch: Obj  # as the store has it once it left in_progress
    store: Store


async def _run(tmp_path, prompts, done_first: int = 0, most: int = 3,
               beside: Beside | None = None, router: Router | None = None,
               kind: str = "msgbatch", expires_at: int = 2 ** 40) -> Ran:
    """A batch of `prompts` (`kind` msgbatch: /v1/messages; batch: /v1/chat/completions), its
    first `done_first` lines already done, run by the runner until it is no longer
    in_progress."""
    cfg = config.load({"Batch__MaxConcurrent": str(most), "Store__Path": str(tmp_path / "s.db")})
    store = open_store(cfg.store, "h", CollectorRegistry())
    endpoint = "/v1/messages" if kind == "msgbatch" else "/v1/chat/completions"
    b = Obj(f"{kind}_h-1", kind, "anonymous", 1, None, 0, "in_progress",
            {"endpoint": endpoint, "expires_at": expires_at,
             "request_counts": {"total": len(prompts), "completed": 0, "failed": 0}})
    await store.run(store.db.add_lines, b, _rows(prompts))
    for i in range(done_first):  # committed before a "restart"
        await store.run(store.db.line_done, b, i, "completed", "{}")
    router = router or Router()
    batches = Batches(lambda: cfg, store, router, beside)
    async with trio.open_nursery() as nursery:
        await nursery.start(batches.run)  # resumes the in_progress batch
        while (await store.run(store.db.get, kind, b.id, None)).state == "in_progress":
            await trio.sleep(1)
        nursery.cancel_scope.cancel()
    got = await store.run(store.db.get, kind, b.id, None)
    return Ran(router, await store.run(store.db.line_states, b.id), got, store)


async def test_lines_once_waits_retried_final_refusals_not(tmp_path, autojump_clock):
    prompts = ["ok", "wait:3", "parked", *[f"ok{i}" for i in range(7)]]
    router, states, b, _ = await _run(tmp_path, prompts)
    assert b.state == "completed"
    assert states == {"completed": 9, "failed": 1}
    assert router.calls["wait:3"] == 4  # three waits for room, then served
    assert router.calls["parked"] == 1  # x-should-retry: false: the line's result at once
    assert all(v == 1 for k, v in router.calls.items() if k.startswith("ok"))
    assert router.most == 3  # Batch__MaxConcurrent


async def test_lines_step_aside_while_other_work_arrives(tmp_path, autojump_clock):
    arrived = [0]

    def counts() -> Arrivals:
        arrived[0] += 1  # an essential chat arrives at every look
        return Arrivals(arrived[0], False, 0)

    router, states, b, _ = await _run(tmp_path, [f"ok{i}" for i in range(12)], most=8,
                                      beside=Beside(counts))
    assert b.state == "completed" and states == {"completed": 12}
    assert router.most == 2  # a quarter of Batch__MaxConcurrent=8
    quiet = await _run(tmp_path / "quiet", [f"ok{i}" for i in range(12)], most=8,
                       beside=Beside(lambda: Arrivals(0, False, 0)))
    assert quiet.router.most == 8


async def test_a_resumed_batch_runs_only_pending_lines(tmp_path, autojump_clock):
    prompts = [f"ok{i}" for i in range(6)]
    router, states, b, _ = await _run(tmp_path, prompts, done_first=4)
    assert states == {"completed": 6} and b.state == "completed"
    assert sorted(router.calls) == ["ok4", "ok5"]


async def test_a_batch_past_its_window_expires_its_pending_lines(tmp_path, autojump_clock):
    import time

    router, states, got, store = await _run(tmp_path, ["ok0", "ok1", "ok2"], kind="batch",
                                            expires_at=int(time.time()) - 1)
    assert got.state == "expired" and got.data["expired_at"]
    assert router.calls == {}
    assert states == {"expired": 3}
    err = await store.run(store.db.get, "file", got.data["error_file_id"], None)
    with open(store.file_path(err.id)) as f:
        codes = [json.loads(x)["error"]["code"] for x in f]
    assert codes == ["batch_expired"] * 3


async def test_an_answer_cut_mid_way_is_tried_again(tmp_path, autojump_clock):
    class Cutting(Router):
        async def __call__(self, scope, receive, send, api) -> None:
            body = json.loads((await receive())["body"])
            said = body["messages"][0]["content"]
            n = self.calls[said] = self.calls.get(said, 0) + 1
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body",
                        "body": b'{"id": "x", "choi' if n == 1 else b'{"id": "x"}'})

    router, states, _, _ = await _run(tmp_path, ["cut"], router=Cutting())
    assert router.calls == {"cut": 2}
    assert states == {"completed": 1}
