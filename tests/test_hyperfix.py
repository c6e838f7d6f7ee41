"""A connection its client closed is closed on our side at once (appliance/server/hyperfix.py),
not after hypercorn's 75 s keep-alive: no CLOSE-WAIT pile-up under load. Plain
connections are served by the lean server (appliance/server/connection.py), TLS ones by hypercorn
with the fix and the listener's guards: both are checked."""

import shutil
import socket
import ssl
from functools import partial

import httpx
import pytest
import trio
from procfs import close_wait

from appliance.http.asgi import send_json, serve


async def _app(scope, receive, send):
    await send_json(send, 200, {"ok": True})


@pytest.fixture(scope="module")
def server_cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command line")
    from test_tls import make_ca, make_cert

    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    return ca[0], make_cert(d, ca, "server")


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_connections_the_client_closed_do_not_linger_in_close_wait(tls, request):
    kw, scheme, verify = {}, "http", True
    if tls:
        ca, (cert, key) = request.getfixturevalue("server_cert")
        kw, scheme, verify = {"certfile": cert, "keyfile": key}, "https", ssl.create_default_context(
            cafile=ca)
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake", **kw))
        # keep-alive connections, closed at exit
        async with httpx.AsyncClient(timeout=10, verify=verify) as c:
            async with trio.open_nursery() as clients:
                for _ in range(20):
                    clients.start_soon(c.get, f"{scheme}://{host}:{port}/")
        # Bounded readiness poll: closed within moments (without the fix: 75 s).
        with trio.move_on_after(10):
            while close_wait(port=port):
                await trio.sleep(0.05)
        assert close_wait(port=port) == 0
        nursery.cancel_scope.cancel()


async def test_tls_connections_keep_the_listeners_guards(server_cert):
    """TE and CL together over TLS (hypercorn and the listener's guard_app): 400 and close."""
    ca, (cert, key) = server_cert
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(partial(serve, _app, "127.0.0.1:0", "fake",
                                                 certfile=cert, keyfile=key))

        def exchange() -> bytes:
            ctx = ssl.create_default_context(cafile=ca)
            with socket.create_connection((host, port), timeout=10) as raw, ctx.wrap_socket(
                    raw, server_hostname="127.0.0.1") as s:
                s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                          b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n")
                got = b""
                try:
                    while chunk := s.recv(65536):
                        got += chunk
                except (ssl.SSLError, ConnectionResetError):
                    pass
                return got

        got = await trio.to_thread.run_sync(exchange)
        nursery.cancel_scope.cancel()
    assert got.startswith(b"HTTP/1.1 400") and b"Transfer-Encoding" in got, got[:300]
    assert got.count(b"HTTP/1.1 ") == 1
