"""Anthropic's stop_sequences end the text where the hub finds one, and the answer names it
(issue 31 item 4): `stop_reason: "stop_sequence"`, `stop_sequence` set -- streamed and
whole -- whatever the engine names (llama-server names none on its OpenAI routes). The
engine is not given the sequences; once one appears the hub ends the answer and closes the
engine's stream, so it stops generating. In-process, on the llama-server-like fake engine of
test_leaving_frees_engine.py (pieces "w0 ", "w1 ", ...)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio

from tests.harness.engine_hub import hub_before
from tests.hub.api.test_leaving_frees_engine import Engine

BODY = {"model": "m", "max_tokens": 300, "stop_sequences": ["w3 ", "never"],
        "messages": [{"role": "user", "content": "count"}]}


async def test_a_whole_answer_names_the_stop_sequence(tmp_path: Path) -> None:
    engine = Engine()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(url + "/v1/messages", json=BODY)
        with trio.fail_after(10):  # the engine's stream is closed once the sequence came
            await engine.closed.wait()
        nursery.cancel_scope.cancel()
    got = r.json()
    assert got["content"] == [{"type": "text", "text": "w0 w1 w2 "}]
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", "w3 ")
    assert "stop" not in engine.bodies[0]


async def test_a_stream_names_the_stop_sequence(tmp_path: Path) -> None:
    engine = Engine()
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(url + "/v1/messages", json={**BODY, "stream": True})
        with trio.fail_after(10):
            await engine.closed.wait()
        nursery.cancel_scope.cancel()
    events = [json.loads(x.split("data: ", 1)[1]) for x in r.text.split("\n\n") if "data: " in x]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == "w0 w1 w2 "
    delta = next(e for e in events if e["type"] == "message_delta")["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "w3 "}
    assert events[-1]["type"] == "message_stop"


async def test_no_sequence_met_ends_as_the_engine_says(tmp_path: Path) -> None:
    engine = Engine(pieces=5, gap=0)
    async with trio.open_nursery() as nursery:
        _, url = await hub_before(nursery, tmp_path, engine)
        async with httpx.AsyncClient(timeout=20) as c:
            r = await c.post(url + "/v1/messages", json={**BODY, "stop_sequences": ["w9"]})
        nursery.cancel_scope.cancel()
    got = r.json()
    assert got["content"][0]["text"] == "w0 w1 w2 w3 w4 "
    assert (got["stop_reason"], got["stop_sequence"]) == ("max_tokens", None)
