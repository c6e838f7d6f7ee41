"""The sim's prefix cache (appliance/sim/cache.py) and what the sim reports of it."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from appliance.config import SimConfig
from appliance.sim.cache import BLOCK_BYTES, BLOCK_TOKENS, PrefixCache, PrefixCaches
from appliance.sim.server import make_sim_app, reconfigure, serve_sim


def test_a_longer_prompt_finds_the_earlier_ones_blocks() -> None:
    c = PrefixCache(32768)
    first = b"x" * (BLOCK_BYTES * 10 + 5)
    assert c.use(first, 400) == 0
    assert c.use(first + b"more" * 100, 500) == 10 * BLOCK_TOKENS
    edited = b"y" + first[1:]
    assert c.use(edited, 400) == 0  # an edit in block 0: nothing before it matches


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    c = PrefixCache(BLOCK_TOKENS * 20)
    a, b = b"a" * BLOCK_BYTES * 12, b"b" * BLOCK_BYTES * 12
    c.use(a, 1000)
    c.use(b, 1000)
    assert len(c.blocks) == 20
    assert c.use(a, 1000) == 0  # a's first blocks were the oldest
    c.use(b"c" * 10_000_000, 10)  # longer than the cache: its first 20 blocks are kept
    assert c.use(b"c" * 10_000_000, 10) == 9  # never the whole prompt (the last is computed)
    assert len(c.blocks) == 20


def test_no_cache_and_free_prefill() -> None:
    caches = PrefixCaches(0, 100.0)
    assert caches.lookup("m", 1, b"z" * 4000, 1000) == (0, 10.0)
    assert caches.lookup("m", 1, b"z" * 4000, 1000) == (0, 10.0)
    free = PrefixCaches(32768, 0.0)
    free.lookup("m", 1, b"z" * 4000, 1000)
    assert free.lookup("m", 1, b"z" * 4000, 1000)[1] == 0.0
    # a reload (loads moved on) starts empty
    assert free.lookup("m", 2, b"z" * 4000, 1000)[0] == 0


@asynccontextmanager
async def running_sim(**kw):
    app = make_sim_app(SimConfig(tokens_per_second=0, **kw))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_sim, app, "127.0.0.1:0")
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}",
                                     timeout=httpx.Timeout(None)) as client:
            yield app, client
        nursery.cancel_scope.cancel()


def convo(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "context " * 500}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t}"},
                 {"role": "assistant", "content": f"answer {t} " * 10}]
    return [*msgs, {"role": "user", "content": "and then?"}]


async def test_turn_two_is_cached_and_its_first_token_comes_sooner(autojump_clock) -> None:
    async with running_sim(cache_tokens=32768, prefill_tokens_per_second=1000) as (app, c):
        await c.post("/api/generate", json={"model": "sim-small"})  # loaded

        async def turn(n: int) -> tuple[float, dict]:
            start = trio.current_time()
            first = None
            usage: dict = {}
            async with c.stream("POST", "/v1/chat/completions", json={
                    "model": "sim-small", "messages": convo(n), "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        first = first if first is not None else trio.current_time() - start
                        ev = json.loads(line[6:])
                        usage = ev.get("usage") or usage
            assert first is not None
            return first, usage

        t1, u1 = await turn(0)
        t2, u2 = await turn(1)
        assert u1["prompt_tokens_details"]["cached_tokens"] == 0
        assert t1 == pytest.approx(u1["prompt_tokens"] / 1000, abs=0.01)
        cached = u2["prompt_tokens_details"]["cached_tokens"]
        assert cached >= u1["prompt_tokens"] - BLOCK_TOKENS - 8
        assert t2 == pytest.approx((u2["prompt_tokens"] - cached) / 1000, abs=0.01)
        assert t2 < t1 / 5
        # non-streamed answers report it too
        r = await c.post("/v1/chat/completions", json={"model": "sim-small",
                                                       "messages": convo(1)})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
        # an unload empties it
        await c.post("/api/generate", json={"model": "sim-small", "keep_alive": 0})
        _, u3 = await turn(1)
        assert u3["prompt_tokens_details"]["cached_tokens"] == 0
        # SIGHUP's reconfigure: no cache now, prefill free
        reconfigure(app, SimConfig(cache_tokens=0, prefill_tokens_per_second=0))
        t4, u4 = await turn(1)
        assert (t4, u4["prompt_tokens_details"]["cached_tokens"]) == (0, 0)
