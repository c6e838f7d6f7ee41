"""A connection its client closed is closed on our side at once (appliance/hyperfix.py),
not after hypercorn's 75 s keep-alive: no CLOSE-WAIT pile-up under load."""

from functools import partial

import httpx
import trio

from appliance.asgi import send_json, serve


def close_wait_on(port: int) -> int:
    """Sockets in CLOSE-WAIT whose local port is `port` (our server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "08" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        n += 1
        except FileNotFoundError:
            pass
    return n


async def _app(scope, receive, send):
    await send_json(send, 200, {"ok": True})


async def test_connections_the_client_closed_do_not_linger_in_close_wait():
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake"))
        async with httpx.AsyncClient(timeout=10) as c:  # keep-alive connections, closed at exit
            async with trio.open_nursery() as clients:
                for _ in range(20):
                    clients.start_soon(c.get, f"http://{host}:{port}/")
        # Bounded readiness poll: closed within moments (without the fix: 75 s).
        with trio.move_on_after(10):
            while close_wait_on(port):
                await trio.sleep(0.05)
        assert close_wait_on(port) == 0
        nursery.cancel_scope.cancel()
