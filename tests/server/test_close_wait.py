"""A connection its client closed is closed on our side at once (appliance/server/connection.py
meets the end of the stream and returns), not after the 75 s keep-alive: no CLOSE-WAIT
pile-up under load -- on plain and TLS listeners alike (the same code path). And the
TLS path keeps the listener's framing rule: TE and CL together are refused."""

import socket
from functools import partial

import httpx
import trio

from appliance.http.asgi import send_json
from appliance.server.serve import serve
from tests.harness.procfs import close_wait


async def _app(scope, receive, send):
    await send_json(send, 200, {"ok": True})


async def test_connections_the_client_closed_do_not_linger_in_close_wait(wire):
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake",
                                                 **wire.serve_kwargs))
        # keep-alive connections, closed at exit
        async with httpx.AsyncClient(timeout=10, verify=wire.ssl_context or True) as c:
            async with trio.open_nursery() as clients:
                for _ in range(20):
                    clients.start_soon(c.get, wire.url(host, port) + "/")
        # Bounded readiness poll: closed within moments (a kept-alive wait would be 75 s).
        with trio.move_on_after(10):
            while close_wait(port=port):
                await trio.sleep(0.05)
        assert close_wait(port=port) == 0
        nursery.cancel_scope.cancel()


async def test_te_and_cl_together_are_refused_by_a_blocking_client_too(wire):
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake",
                                                 **wire.serve_kwargs))

        def exchange() -> bytes:
            with socket.create_connection((host, port), timeout=10) as raw, wire.wrap(raw) as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                          b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
                got = b""
                try:
                    while chunk := s.recv(65536):
                        got += chunk
                except (OSError, ConnectionResetError):  # ssl.SSLError is an OSError
                    pass
                return got

        got = await trio.to_thread.run_sync(exchange)
        nursery.cancel_scope.cancel()
    assert got.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding" in got, got[:300]
    assert got.count(b"HTTP/1.1 ") == 1
