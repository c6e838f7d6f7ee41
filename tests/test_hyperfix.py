"""A connection its client closed is closed on our side at once (appliance/hyperfix.py),
not after hypercorn's 75 s keep-alive: no CLOSE-WAIT pile-up under load."""

import os
import sys
from functools import partial
from pathlib import Path

import httpx
import trio

from appliance.asgi import send_json, serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from soak import proc_stats  # noqa: E402


async def _app(scope, receive, send):
    await send_json(send, 200, {"ok": True})


async def test_connections_the_client_closed_do_not_linger_in_close_wait():
    # Sockets an earlier test in this process left in CLOSE-WAIT are not this test's.
    before = proc_stats(os.getpid())["close_wait"]
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake"))
        async with httpx.AsyncClient(timeout=10) as c:  # keep-alive connections, closed at exit
            async with trio.open_nursery() as clients:
                for _ in range(20):
                    clients.start_soon(c.get, f"http://{host}:{port}/")
        # Bounded readiness poll: closed within moments (without the fix: 75 s).
        with trio.move_on_after(10):
            while proc_stats(os.getpid())["close_wait"] > before:
                await trio.sleep(0.05)
        assert proc_stats(os.getpid())["close_wait"] <= before
        nursery.cancel_scope.cancel()
