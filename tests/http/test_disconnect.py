"""Cancel on disconnect (appliance/http/stream.py): the server's hang-up watch
(appliance/server/send.py) and the watcher task."""

from __future__ import annotations

import socket

import pytest
import trio

from appliance.http.stream import cancel_on_disconnect, hangup_watch
from appliance.server.send import Hangups, hangups
from appliance.server.serve import serve

REQUEST = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"


def _app(seen: dict, finished: bool = False, use_scope: bool = True):
    """Waits (forever) inside cancel_on_disconnect; records how it ended."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()  # the body
        seen["socket"] = hangup_watch(scope) is not None
        try:
            async with cancel_on_disconnect(receive, (lambda: True) if finished else None,
                                            scope if use_scope else None) as g:
                if use_scope:  # watched by the one task, not by a watcher of its own
                    h = hangups()
                    seen["watched"] = h.watching() if h is not None else 0
                seen["entered"].set()
                await trio.sleep_forever()
        finally:
            seen["gone"] = g.gone
            seen["ended"].set()
    return app


async def _start(nursery, app) -> tuple[str, int]:
    stop = trio.Event()
    host, port = await nursery.start(lambda task_status: serve(
        app, "127.0.0.1:0", "sim", shutdown_trigger=stop.wait, drain_seconds=0.1,
        task_status=task_status))
    return host, port


async def _entered(nursery, **app) -> tuple[dict, trio.SocketStream]:
    """What `_app(**app)` saw, and the client whose request it has entered."""
    seen: dict = {"entered": trio.Event(), "ended": trio.Event()}
    host, port = await _start(nursery, _app(seen, **app))
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(REQUEST)
    with trio.fail_after(10):
        await seen["entered"].wait()
    return seen, stream


@pytest.mark.parametrize("use_scope", [True, False])
async def test_a_client_that_hangs_up_cancels_the_work(use_scope):
    async with trio.open_nursery() as nursery:
        seen, stream = await _entered(nursery, use_scope=use_scope)
        await stream.aclose()
        with trio.fail_after(10):
            await seen["ended"].wait()
        nursery.cancel_scope.cancel()
    assert seen["socket"] is True  # our server offers its watch
    assert seen.get("watched", 1) == 1
    assert seen["gone"] is True


async def test_a_finished_answer_is_not_cut_by_the_hang_up(autojump_clock):
    async with trio.open_nursery() as nursery:
        seen, stream = await _entered(nursery, finished=True)
        await stream.aclose()
        with trio.move_on_after(0.5):  # nothing ends it: the work goes on
            await seen["ended"].wait()
        assert not seen["ended"].is_set()
        nursery.cancel_scope.cancel()
    assert seen["gone"] is False


async def test_the_watcher_calls_only_for_a_hang_up_and_forgets_the_socket():
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    h = Hangups()
    calls: list[str] = []
    fa, fc = a.fileno(), c.fileno()
    assert h.add(fa, lambda: calls.append("a")) and h.add(fc, lambda: calls.append("c"))
    assert not h.add(fa, lambda: calls.append("again"))  # one watch per socket
    b.send(b"GET / HTTP/1.1\r\n")  # bytes (a pipelined request) are no hang-up
    h.fire()
    assert calls == []
    d.close()  # c's peer hangs up
    h.fire()
    assert calls == ["c"]
    h.fire()
    assert calls == ["c"]  # once
    h.remove(fa)
    b.close()
    h.fire()
    assert calls == ["c"] and h.watching() == 0
    h.remove(fc)  # already gone: nothing to do
    for s in (a, b, c):
        s.close()


async def test_fake_scopes_fall_back_to_the_watcher_task():
    msgs = [{"type": "http.disconnect"}]

    async def receive():
        if msgs:
            return msgs.pop()
        await trio.sleep_forever()

    with trio.fail_after(5):
        async with cancel_on_disconnect(receive, scope={"state": {}}) as g:
            await trio.sleep_forever()
    assert g.gone
