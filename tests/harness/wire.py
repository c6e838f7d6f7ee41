"""Both kinds of listener, for the suites that run over each (test_h1, test_listener_reload,
test_close_wait, the hostile e2e tests): a plain one and a TLS one with a certificate from
a CA the test session makes (tests/harness/pki.py, trustme).

`wire` (a fixture, conftest.py) is a `Wire`: `serve_kwargs` for appliance.server.serve.serve
(the certificate, or nothing), `connect(host, port)` for a trio stream to it, `url(host,
port)`, `sock(stream)` for the TCP socket under a stream (to set SO_LINGER), and for blocking
clients `wrap(sock)` / `ssl_context`.
"""

from __future__ import annotations

import socket
import ssl

import trio

KINDS = ["plain", "tls"]


class Wire:
    def __init__(self, kind: str, pki: tuple[str, str, str] | None = None) -> None:
        self.kind = kind
        self.tls = kind == "tls"
        self.ca, self.cert, self.key = pki if pki is not None else ("", "", "")
        self.ssl_context = ssl.create_default_context(cafile=self.ca) if self.tls else None

    @property
    def serve_kwargs(self) -> dict[str, str]:
        return {"certfile": self.cert, "keyfile": self.key} if self.tls else {}

    @property
    def env(self) -> dict[str, str]:
        """A hub's environment for this kind of listener."""
        return {"Hub__TlsCert": self.cert, "Hub__TlsKey": self.key} if self.tls else {}

    def url(self, host: str, port: int) -> str:
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    async def connect(self, host: str, port: int, handshake: bool = True) -> trio.abc.Stream:
        """A stream to the listener; TLS: the handshake now, or (`handshake=False`) with the
        first write -- a connection still in the kernel's backlog cannot shake hands."""
        tcp = await trio.open_tcp_stream(host, port)
        if not self.tls:
            return tcp
        assert self.ssl_context is not None
        stream = trio.SSLStream(tcp, self.ssl_context, server_hostname=host,
                                https_compatible=True)
        if handshake:
            await stream.do_handshake()
        return stream

    @staticmethod
    def sock(stream: trio.abc.Stream) -> trio.socket.SocketType:
        s = getattr(stream, "transport_stream", stream)
        assert isinstance(s, trio.SocketStream)
        return s.socket

    def wrap(self, raw: socket.socket, host: str = "127.0.0.1") -> socket.socket:
        """A blocking client socket, TLS-wrapped for a TLS listener."""
        if not self.tls:
            return raw
        assert self.ssl_context is not None
        return self.ssl_context.wrap_socket(raw, server_hostname=host)
