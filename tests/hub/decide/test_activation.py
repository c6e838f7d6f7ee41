"""The activation waiter in virtual time: exact bounds, early exits, ask first."""

from __future__ import annotations

import pytest
import trio

from appliance.http.errors import ApiError
from appliance.hub.decide import activation
from tests.hub.decide.test_control import make


class FakeSource:
    """A control plane whose decision and readiness arrive at given virtual times."""

    def __init__(self, ready_at: float | None = None, unservable_at: float | None = None,
                 decided_at: float = 0.0) -> None:
        self.ready_at, self.unservable_at, self.decided_at = ready_at, unservable_at, decided_at
        self.calls: list[str] = []
        self.gen = 0
        self.stale = ApiError(503, "model_unplaceable", "stale: needs 9800 MiB")

    def ask(self, model):
        self.calls.append("ask")
        self.stale = None  # asking clears the previous placement result
        self.gen += 1
        return self.gen

    async def wait_decided(self, model, generation):
        self.calls.append(f"wait_decided {generation}")
        await trio.sleep_until(self.decided_at)

    def has_ready(self, model):
        return self.ready_at is not None and trio.current_time() >= self.ready_at

    def why_unservable(self, model):
        if self.stale is not None:
            return self.stale
        if self.unservable_at is not None and trio.current_time() >= self.unservable_at:
            return ApiError(503, "model_parked", "parked: unknown model architecture: 'kev'")
        return None


async def test_ready_in_time(autojump_clock):
    src = FakeSource(ready_at=3.1)
    start = trio.current_time()
    await activation.activate(src, "m", 45)
    assert trio.current_time() == start + 3.25  # the first poll after it became ready
    assert src.calls == ["ask", "wait_decided 1"]


async def test_timed_out_with_the_exact_bound(autojump_clock):
    src = FakeSource()
    start = trio.current_time()
    with pytest.raises(ApiError) as info:
        await activation.activate(src, "m", 45)
    assert trio.current_time() == start + 45
    err = info.value
    assert (err.status, err.code, err.retry_after) == (503, "model_loading",
                                                       activation.RETRY_AFTER_SECONDS)
    assert "loading; retry shortly" in err.message
    assert (b"retry-after", b"5") in err.headers()


async def test_the_bound_covers_waiting_for_the_decision(autojump_clock):
    src = FakeSource(decided_at=100.0)
    start = trio.current_time()
    with pytest.raises(ApiError):
        await activation.activate(src, "m", 10)
    assert trio.current_time() == start + 10


async def test_unservable_mid_wait_returns_at_once(autojump_clock):
    src = FakeSource(unservable_at=7.6)
    start = trio.current_time()
    with pytest.raises(ApiError) as info:
        await activation.activate(src, "m", 45)
    assert trio.current_time() == start + 7.75  # the next poll, not the end of the window
    assert info.value.code == "model_parked" and info.value.retry_after is None


async def test_ask_first_clears_the_stale_result(autojump_clock):
    src = FakeSource(ready_at=1.0)
    await activation.activate(src, "m", 45)  # the stale "unplaceable" never answers the request
    assert src.calls[0] == "ask"


async def test_ask_first_clears_a_stale_unplaceable_in_the_real_control(nursery, autojump_clock):
    from tests.hub.decide.test_control import add_node

    control, registry, ops, _, _ = make([{"Name": "phi-4", "MemoryMb": 9800}],
                                        {"gpu-a": (8000, {"phi-4": 100})})
    await nursery.start(control.run)
    with pytest.raises(ApiError):
        await control.activate("phi-4")
    assert control.why_unservable("phi-4").code == "model_unplaceable"  # the stored result
    add_node(registry, "gpu-b", 12000, {"phi-4": 100})
    ops.load_seconds = 0.9
    start = trio.current_time()
    await control.activate("phi-4")  # asks first: placed on gpu-b, not refused on the stale answer
    assert trio.current_time() == start + 1.0
    assert [n.name for n in registry.ready_nodes("phi-4")] == ["gpu-b"]
