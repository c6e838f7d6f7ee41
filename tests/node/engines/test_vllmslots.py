"""vLLM's load as the node learns it (appliance/node/engines/vllmslots.py, issue 27):
`/metrics` running + waiting per model and max_num_seqs, from a fake vLLM; absurd numbers
bounded and said once; an upstream without /metrics is not asked again."""

from __future__ import annotations

import json
import logging
from functools import partial

import trio

from appliance.config import Config, EngineConfig
from appliance.node.engines import vllmslots
from appliance.node.engines.openai import OpenAIEngine
from appliance.node.engines.vllmslots import LOAD_POLL_SECONDS, MAX_REQUESTS, MAX_SEQS, parse
from appliance.server.serve import serve

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def page(running: float, waiting: float, seqs: int | None = 256, engines: int = 1) -> str:
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge"]
    for e in range(engines):
        lines += [f'vllm:num_requests_running{{engine="{e}",model_name="{MODEL}"}} {running}',
                  f'vllm:num_requests_waiting{{engine="{e}",model_name="{MODEL}"}} {waiting}']
    if seqs is not None:
        lines.append(f'vllm:cache_config_info{{block_size="16",max_num_seqs="{seqs}"}} 1.0')
    lines.append('vllm:prompt_tokens_total{model_name="x"} 12.0')
    return "\n".join(lines) + "\n"


class FakeVllm:
    """/v1/models and /metrics as vLLM serves them; `metrics` None answers 404."""

    def __init__(self) -> None:
        self.metrics: str | None = page(0, 0)
        self.asked = 0

    async def __call__(self, scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/models":
            status, body, ctype = 200, json.dumps({"data": [{"id": MODEL}]}).encode(), b"application/json"
        elif scope["path"] == "/metrics":
            self.asked += 1
            status = 404 if self.metrics is None else 200
            body, ctype = (self.metrics or "not found").encode(), b"text/plain"
        else:
            status, body, ctype = 404, b"{}", b"application/json"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": body})


def test_running_and_waiting_summed_over_engines_and_bounded(caplog):
    loads, seqs = parse(page(3, 2, engines=2))
    assert loads[MODEL].running == 6 and loads[MODEL].waiting == 4 and loads[MODEL].busy == 10
    assert seqs == 256 and "x" not in loads  # other series are not load
    assert parse("garbage\nvllm:num_requests_running 3\n") == ({}, None)  # no model: skipped
    vllmslots._said.clear()
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        loads, seqs = parse(page(-5, 1e12, seqs=10**8))
    assert loads[MODEL].running == 0 and loads[MODEL].waiting == MAX_REQUESTS
    assert seqs == MAX_SEQS
    assert loads[MODEL].busy <= 2 * MAX_REQUESTS
    said = [r.message for r in caplog.records]
    assert len(said) == 3  # running, waiting, max_num_seqs: each once, not once a read
    loads, _ = parse(page(float("nan"), float("inf")))
    assert loads[MODEL].running == 0 and loads[MODEL].waiting == 0


async def test_busy_and_slots_from_a_fake_vllm_then_no_metrics_no_asking(autojump_clock):
    fake = FakeVllm()
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, fake, "127.0.0.1:0", "vllm"))
        engine = OpenAIEngine(Config(engine=EngineConfig(kind="openai",
                                                         url=f"http://{host}:{port}/v1")))
        changes: list[float] = []
        engine.on_change = lambda: changes.append(trio.current_time())
        await nursery.start(engine.run)
        await trio.sleep(LOAD_POLL_SECONDS * 1.5)
        m, = engine.models()
        assert (m.name, m.slots, m.busy) == (MODEL, 256, 0)
        fake.metrics = page(200, 40)  # load from outside the hub: 200 running, 40 waiting
        await trio.sleep(LOAD_POLL_SECONDS)
        m, = engine.models()
        assert (m.slots, m.busy) == (256, 240)
        seen = len(changes)
        await trio.sleep(LOAD_POLL_SECONDS * 3)
        assert len(changes) == seen  # the same numbers: no change said
        fake.metrics = None  # not vLLM after all (or /metrics off): 404
        await trio.sleep(LOAD_POLL_SECONDS)
        asked = fake.asked
        m, = engine.models()
        assert (m.slots, m.busy) == (None, None)  # it says nothing now
        await trio.sleep(LOAD_POLL_SECONDS * 5)
        assert fake.asked == asked  # not asked again
        nursery.cancel_scope.cancel()
