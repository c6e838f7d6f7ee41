"""llama-server's slots as the node learns them (appliance/node/engines/llamaslots.py):
`/props` total_slots and `/slots` busy, from tests/harness/fake_llama_server.py; absurd
numbers bounded and logged once."""

from __future__ import annotations

import logging
import shlex
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx
import trio

from appliance import config
from appliance.node.engines import llamaslots
from appliance.node.engines.base import Changed, unheard
from appliance.node.engines.llamacpp import LlamaCppEngine
from appliance.node.engines.llamaslots import MAX_ENGINE_SLOTS, busy_slots, engine_slots
from tests.harness import HARNESS

FAKE = HARNESS / "fake_llama_server.py"


async def loaded(nursery: trio.Nursery, tmp_path: Path, name: str, args: str,
                 on_change: Changed = unheard) -> LlamaCppEngine:
    """An engine running the fake with `args`, its model `name` (a tiny GGUF file) loaded."""
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 1024)
    cmd = (f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} -m {{model}} "
           f"--port {{port}} {args} {{args}}")
    eng = LlamaCppEngine(config.load({"Engine__Kind": "llamacpp", "Engine__Command": cmd}),
                         on_change)
    await nursery.start(eng.run)
    with trio.fail_after(20):
        await eng.load(name, str(path))
    return eng


class Changes:
    """An engine's `on_change`: `wait_until` looks at its condition again on each change
    the engine says, and between them waits on no clock."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    def __call__(self) -> None:
        self._changed.set()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        while True:
            self._changed = trio.Event()
            if condition():
                return
            await self._changed.wait()


def test_numbers_from_the_engine_are_bounded(caplog):
    assert engine_slots(4, "m") == 4
    assert engine_slots("4", "m") is None and engine_slots(True, "m") is None
    llamaslots._said_absurd.clear()
    with caplog.at_level(logging.WARNING, logger="appliance.node.engines.llamaslots"):
        assert engine_slots(10**9, "m") == MAX_ENGINE_SLOTS
        assert engine_slots(10**9, "m") == MAX_ENGINE_SLOTS
        assert engine_slots(0, "m") == 1
    assert len(caplog.records) == 1  # once per model
    assert busy_slots([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}]) == 1
    assert busy_slots([{"id": 0, "state": 1}, {"id": 1, "state": 0}]) == 1  # older servers
    assert busy_slots({"slots": []}) is None and busy_slots([1]) is None
    assert busy_slots([{}] * (4 * MAX_ENGINE_SLOTS + 1)) is None


async def test_slots_and_busy_from_props_and_slots(nursery, tmp_path, monkeypatch):
    monkeypatch.setattr(llamaslots, "SLOTS_POLL_SECONDS", 0.05)  # a busy change seen at once
    changes = Changes()
    # Each completion held until /fake/release.
    eng = await loaded(nursery, tmp_path, "tiny", "-np 3 --fake-hold 60", changes)
    (m,) = eng.models()
    assert m.slots == 3
    base = eng.upstream("tiny")

    def busy() -> int | None:
        return eng.models()[0].busy

    async def post(path: str, body: dict[str, object]) -> None:
        async with httpx.AsyncClient(timeout=20, trust_env=False) as c:
            (await c.post(base + path, json=body)).raise_for_status()

    one = partial(post, "/v1/chat/completions", {"messages": [], "max_tokens": 1})
    with trio.fail_after(20):
        await changes.wait_until(lambda: busy() == 0)
        async with trio.open_nursery() as n:
            n.start_soon(one)
            n.start_soon(one)
            await changes.wait_until(lambda: busy() == 2)  # seen busy while they are held
            await post("/fake/release", {})
        await changes.wait_until(lambda: busy() == 0)
    await eng.unload("tiny")
    assert eng.models()[0].slots is None  # not ready: nothing said


async def test_an_absurd_slot_count_is_bounded(nursery, tmp_path):
    eng = await loaded(nursery, tmp_path, "huge", "--fake-total-slots 100000000")
    assert eng.models()[0].slots == MAX_ENGINE_SLOTS
