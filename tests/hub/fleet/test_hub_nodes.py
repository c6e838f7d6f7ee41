"""The hub's node registry decisions and its supervisor loop, under trio's MockClock (a
handler that raises is a node that closes the connection before answering:
tests/harness/watch.py)."""

import httpx
import pytest
import trio

from appliance.hub.decide.priority import count, ready_nodes
from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.fleet.supervisor import BACKOFF_START
from appliance.wire import Heartbeat, ModelState, NodeState, StateEvent, encode_event
from tests.harness.watch import supervising


def _node(name, *, models=("m",), max_conc=None, slots=None, paused=False, state="ready"):
    h = NodeHandle(name, f"http://{name}:1", static=True)
    h.connected = True
    h.state = NodeState(name=name, max_concurrency=max_conc, slots=slots, paused=paused,
                        models=[ModelState(name=m, state=state) for m in models])
    return h


def _registry(*handles):
    r = Registry()
    for h in handles:
        r.nodes[h.name] = h
    return r


def _places(r, model):
    """The fleet's free places for `model`, counted as admission counts them."""
    return count(ready_nodes(r.nodes.values(), model), model).places


def test_status_order_and_routable():
    h = _node("a")
    assert h.status() == "up" and h.routable()
    h.cordoned = True
    assert h.status() == "cordoned" and not h.ready("m")
    h.state.paused = True
    assert h.status() == "paused"
    h.state.left = True
    assert h.status() == "left"
    h.connected = False
    assert h.status() == "lost"


def test_free_places_is_lesser_of_concurrency_and_slots():
    a = _node("a", max_conc=4, slots=2)
    b = _node("b", slots=1)
    r = _registry(a, b)
    assert _places(r, "m") == 3
    r.start(a, "m")
    r.start(a, "m")
    assert a.places_left("m") == 0
    assert _places(r, "m") == 1
    r.finish(a, "m")
    assert _places(r, "m") == 2
    # An unbounded node gives nothing to count: nothing is held.
    r.nodes["c"] = _node("c")
    assert _places(r, "m") is None
    # Not ready, paused, lost: out of the count.
    r.nodes["c"].state.paused = True
    assert _places(r, "m") == 2


def test_pick_prefers_most_free_and_skips_excluded():
    a = _node("a", slots=1)
    b = _node("b", slots=3)
    r = _registry(a, b)
    assert r.pick("m").name == "b"
    assert r.pick("m", exclude={"b"}).name == "a"
    for _ in range(3):
        r.start(b, "m")
    assert r.pick("m").name == "a"
    assert r.pick("other") is None


def test_pick_respects_max_concurrency():
    a = _node("a", max_conc=1)
    r = _registry(a)
    r.start(a, "m")
    assert r.pick("m") is None


def _watch(script, headers=None):
    """A handler whose /node/v1/watch yields `script` lines with virtual pauses, once
    (`headers`: the watch answer's, e.g. the node's heartbeat interval)."""

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            for delay, item in script:
                await trio.sleep(delay)
                if item is None:
                    return
                yield item

    served = []

    async def handler(request):
        if served:
            raise httpx.ConnectError("refused")
        served.append(1)
        return httpx.Response(200, stream=Stream(), headers=headers or {})

    return handler


async def test_lost_after_three_missed_heartbeats(autojump_clock):
    state = NodeState(name="a", models=[ModelState(name="m", state="ready")])
    script = [(0, encode_event(StateEvent(state=state))), (1, encode_event(Heartbeat())), (100,
                                                                                           None)]
    async with supervising(_watch(script)) as s:
        await trio.sleep(0.5)
        assert s.h.connected and s.h.ready("m")
        await trio.sleep(7.0)  # heartbeat at 1 s; silence from then on: lost at 1 + 3 x 2 = 7 s
        assert not s.h.connected and s.h.status() == "lost"
    assert s.events[0][0] == "node_up"
    kind, at, reason = s.events[1]
    assert kind == "node_lost" and at == 7.0 and "no heartbeat for 6 s" in reason


@pytest.mark.parametrize("said, lost_at", [("0.5", 1 + 1.5), ("4", 1 + 12.0), ("nan", 7.0),
                                           ("1e9", 1 + 900.0), ("0", 0.15)])
async def test_lost_after_three_of_the_nodes_own_heartbeats(autojump_clock, said, lost_at):
    # The node says its interval on the watch stream; the hub counts 3 of those (bounded:
    # 0.05..300 s), not 3 of its own Node__HeartbeatSeconds (2 s here).
    state = NodeState(name="a", models=[ModelState(name="m", state="ready")])
    script = [(0, encode_event(StateEvent(state=state))), (1, encode_event(Heartbeat())),
              (10_000, None)]
    async with supervising(_watch(script, {"x-appliance-heartbeat": said})) as s:
        await trio.sleep(lost_at + 0.01)
    assert [k for k, _, _ in s.events[:2]] == ["node_up", "node_lost"]
    assert s.events[1][1] == pytest.approx(lost_at)


async def test_backoff_is_capped_and_reconnects(autojump_clock):
    attempts = []

    async def handler(request):
        attempts.append(trio.current_time())
        raise httpx.ConnectError("refused")

    async with supervising(handler, backoff_max=8.0) as s:
        await trio.sleep(200)
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[0] <= BACKOFF_START
    assert max(gaps) <= 8.0 and max(gaps) >= 4.0  # jittered in [cap/2, cap]
    assert len(attempts) > 20  # it kept trying
    assert s.h.lost_reason == "closed the connection before answering"


async def test_announced_url_change_reconnects_at_once(autojump_clock):
    calls = []

    async def handler(request):
        calls.append((str(request.url), trio.current_time()))
        raise httpx.ConnectError("refused")

    async with supervising(handler, static=False, backoff_max=600) as s:
        await trio.sleep(100)
        t = trio.current_time()
        s.reg.upsert("a", "http://a2:1", static=False)
        await trio.sleep(0.01)
    assert calls[-1][0].startswith("http://a2:1/") and calls[-1][1] == t


async def test_a_node_never_reached_is_logged_once_per_reason(autojump_clock, caplog):
    async def handler(request):
        raise httpx.ConnectError("connection refused")

    async with supervising(handler, name="far", backoff_max=8.0):
        await trio.sleep(300)
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert said == [
        "node far at http://far:1 unreachable: closed the connection before answering (retrying "
        "with backoff)"]


def test_pick_spreads_equal_nodes_evenly():
    # 300 requests at once on three equal nodes: bounded or not, each gets a third.
    for slots in (None, 4):
        nodes = [_node(n, slots=slots) for n in ("a", "b", "c")]
        r = _registry(*nodes)
        got = {"a": 0, "b": 0, "c": 0}
        for _ in range(300):
            h = r.pick("m")
            got[h.name] += 1
            r.start(h, "m")
        assert got == {"a": 100, "b": 100, "c": 100}, (slots, got)


def test_pick_spreads_under_churn_and_a_retry_goes_to_the_least_loaded_other():
    import random

    rnd = random.Random(7)
    nodes = [_node(n, slots=2) for n in ("a", "b", "c")]
    r = _registry(*nodes)
    running: list = []
    got = {"a": 0, "b": 0, "c": 0}
    for _ in range(3000):
        if running and rnd.random() < 0.5:
            r.finish(running.pop(rnd.randrange(len(running))), "m")
        else:
            h = r.pick("m")
            got[h.name] += 1
            r.start(h, "m")
            running.append(h)
    assert all(abs(n - sum(got.values()) / 3) <= 0.15 * sum(got.values()) / 3
               for n in got.values()), got
    # Equal free places, ties broken by turn -- not always the first node.
    fresh = _registry(*[_node(n) for n in ("a", "b", "c")])
    assert {fresh.pick("m").name for _ in range(3)} == {"a", "b", "c"}
    # A retry (a excluded) goes to the least loaded of the others.
    a, b, c = (fresh.nodes[n] for n in "abc")
    fresh.start(b, "m")
    assert fresh.pick("m", exclude={"a"}) is c
    # Over-full slots still order: b with 3 in flight on 2 slots loses to c with 2.
    s = _registry(_node("b", slots=2), _node("c", slots=2))
    for _ in range(3):
        s.start(s.nodes["b"], "m")
    for _ in range(2):
        s.start(s.nodes["c"], "m")
    assert s.pick("m").name == "c"


async def test_announcement_from_a_lost_node_dials_it_at_once(autojump_clock):
    state = NodeState(name="a", models=[ModelState(name="m", state="ready")])
    calls = []
    back = []

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield encode_event(StateEvent(state=state))
            while True:
                await trio.sleep(1)
                yield encode_event(Heartbeat())

    async def handler(request):
        calls.append(trio.current_time())
        if not back:
            raise httpx.ConnectError("refused")
        return httpx.Response(200, stream=Stream())

    async with supervising(handler, static=False, backoff_max=60) as s:
        await trio.sleep(300)  # away for long: the backoff is at its cap
        assert not s.h.connected and calls[-1] - calls[-2] >= 30
        back.append(1)
        t = trio.current_time()
        s.reg.upsert("a", "http://a:1", static=False)  # it announces itself, same URL
        await trio.sleep(0.01)
        assert calls[-1] == t and s.h.connected and s.h.ready("m")
        n = len(calls)
        s.reg.upsert("a", "http://a:1", static=False)  # announcing while connected: no new dial
        await trio.sleep(10)
        assert len(calls) == n
