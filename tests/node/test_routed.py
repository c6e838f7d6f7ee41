"""A node watched by several hubs says at once where their keyed requests went and how many
run (appliance/node/routed.py, issue 27); watched by one it waits for the heartbeat."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from appliance.node.routed import ROUTED_KEEP, ROUTED_SECONDS, RoutedLog, note_route, valid_key
from appliance.wire import ROUTE_HEADER, StateEvent, watch_decoder
from tests.node.test_node_app import CHAT, running_node

KEY = "p0123456789abcdef"


async def test_two_watchers_see_a_keyed_request_and_its_count_before_any_heartbeat():
    async with running_node(Node__HeartbeatSeconds="300") as n, AsyncExitStack() as stack:
        streams = []
        for _ in range(2):
            r = await stack.enter_async_context(n.http.stream("GET", "/node/v1/watch"))
            lines = r.aiter_lines()
            with trio.fail_after(5):
                assert isinstance(watch_decoder.decode(await lines.__anext__()), StateEvent)
            streams.append(lines)
        n.upstream.gate = trio.Event()  # the answer stays open: the request runs
        async with trio.open_nursery() as ns:
            async def send() -> None:
                async with n.http.stream("POST", "/v1/chat/completions", json=CHAT,
                                         headers={ROUTE_HEADER: KEY}) as r:
                    assert r.status_code == 200
                    await r.aread()
            ns.start_soon(send)
            for lines in streams:  # no heartbeat for 300 s: this is the push
                with trio.fail_after(5):
                    ev = watch_decoder.decode(await lines.__anext__())
                    while not ev.state.routed:  # type: ignore[union-attr]
                        ev = watch_decoder.decode(await lines.__anext__())
                assert isinstance(ev, StateEvent)
                assert [(r.model, r.key) for r in ev.state.routed] == [("sim-small", KEY)]
                assert ev.state.model("sim-small").in_flight == 1  # type: ignore[union-attr]
            n.upstream.gate.set()
        # Answered: the node's mean time per answer, for a hub with none of its own yet.
        m = n.keeper.snapshot().model("sim-small")
        assert m is not None and m.service_ms is not None and m.service_ms >= 1


async def test_one_watcher_keeps_no_keys():
    async with running_node(Node__HeartbeatSeconds="300") as n:
        async with n.http.stream("GET", "/node/v1/watch") as w:
            lines = w.aiter_lines()
            with trio.fail_after(5):
                await lines.__anext__()
            r = await n.http.post("/v1/chat/completions", json=CHAT, headers={ROUTE_HEADER: KEY})
            assert r.status_code == 200
            assert n.keeper.watchers == 1
            assert n.keeper.snapshot().routed == []
            assert n.keeper.snapshot().model("sim-small").service_ms is None  # type: ignore[union-attr]


def test_keys_are_bounded_checked_and_forgotten():
    assert valid_key(b"s" + b"ab" * 16 + b",2048") is not None
    for bad in (b"", b"P0123", b"p01 23", b"s" + b"a" * 60, "p\u00e9".encode()):
        assert valid_key(bad) is None
    log = RoutedLog()
    for i in range(ROUTED_KEEP + 10):
        log.note("m", KEY, float(i) / 100)
    recent = log.recent(2.0)
    assert len(recent) == ROUTED_KEEP and recent[-1].seq == ROUTED_KEEP + 10
    assert log.recent(2.0 + ROUTED_SECONDS) == []

    class Keeper:
        def __init__(self) -> None:
            self.noted: list[tuple[str, str]] = []

        def note_routed(self, model: str, key: str) -> None:
            self.noted.append((model, key))

    k = Keeper()
    note_route(k, "m", [(b"accept", b"*/*"), (ROUTE_HEADER.encode(), b"p\x00")])
    note_route(k, "m", [(ROUTE_HEADER.encode(), KEY.encode())])
    assert k.noted == [("m", KEY)]
