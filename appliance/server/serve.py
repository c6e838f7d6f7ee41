"""How every role serves its ASGI app: bind, say where, accept, drain.

Theory of operation: `serve` binds the listener (a `HOST:PORT`, or an inherited socket
`fd://N`, or `unix:PATH` -- the hub's workers), loads the TLS files when given (refused
with one line naming the variable when they cannot be used), prints the one
`appliance <role> listening on http://HOST:PORT` line the contract promises, and hands
the bound (host, port) to `task_status.started` only once the socket listens. The
connections are then appliance/server/accept.py's, plain and TLS alike.

TLS offers only HTTP/1.1 (ALPN `http/1.1`): the connection speaks nothing else, and a
client that asks for h2 falls back, as every HTTP client does.

Why TLS is not hypercorn's (issue 19): through its public interface (Config and ASGI
middleware) the head deadline cannot be kept -- a head trickled a byte a second never
reaches any middleware, and hypercorn's `read_timeout` is per read -- nor the connection
bound with shedding (no hook at accept) nor the prompt close of a connection its client
left; keeping them took a private TCPServer subclass and a monkeypatch. So TLS runs the
same connection as plain TCP, over trio's SSLStream: one code path, one suite.
"""

from __future__ import annotations

import os
import socket
import ssl
import stat
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from appliance.config import parse_listen
from appliance.http.asgi import App
from appliance.server.accept import Settings, serve_sockets
from appliance.server.limits import Limits, LiveLimits, live_limits

DEFAULT_LIMITS = Limits()

# Connections the kernel holds for us before we accept them: a burst of clients
# connecting at once (1,000 in bench/soak.py) overran 100; the kernel caps it at
# net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 4096
# The idle keep-alive bound between requests (hypercorn's, which served here before).
KEEP_ALIVE_SECONDS = 75.0
# Ciphers a TLS listener offers (TLS 1.2; TLS 1.3's are fixed): forward-secret AEAD only.
TLS_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class StartupError(Exception):
    """A listener could not start: one line naming the variable (the CLI exits 2)."""


def same_port(metrics_listen: str, api_listen: str, api_var: str) -> None:
    """Metrics on the API's own port would fail to bind (or worse, on another address):
    refused before anything starts."""
    if not metrics_listen:
        return
    _, mport = parse_listen(metrics_listen, "Metrics__Listen")
    _, aport = parse_listen(api_listen, api_var)
    if mport and mport == aport:
        raise StartupError(
            f"Metrics__Listen={metrics_listen!r} is the API's port ({api_var}={api_listen!r}): "
            "give metrics a port of its own, or empty for no metrics server")


# The variables each role's listener comes from, for start-up errors.
_SECTION = {"hub": "Hub", "node": "Node", "sim": "Sim", "metrics": "Metrics"}

# What `serve` hands to `nursery.start`: the bound (host, port).
Bound = trio.TaskStatus[tuple[str, int]]


def listening_socket(bind: str) -> socket.socket:
    """A bound, listening, non-blocking socket for `HOST:PORT`, `fd://N` or `unix:PATH`."""
    if bind.startswith("fd://"):
        sock = socket.socket(fileno=int(bind[5:]))
    elif bind.startswith("unix:"):
        path = bind[5:]
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                os.remove(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(path)
    else:
        host, _, port = bind.rpartition(":")
        host = host.strip("[]")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, int(port)))
        except BaseException:
            sock.close()
            raise
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


def tls_context(certfile: str, keyfile: str = "", ca_certs: str = "",
                require_client_cert: bool = False) -> ssl.SSLContext:
    """The server's TLS: TLS 1.2 or later, no compression, HTTP/1.1 by ALPN; with
    `ca_certs`, client certificates verified against it (required or optional)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION
    ctx.set_ciphers(TLS_CIPHERS)
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(certfile, keyfile or certfile)
    if ca_certs:
        ctx.load_verify_locations(ca_certs)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    return ctx


def _where(sock: socket.socket) -> tuple[str, int]:
    name = sock.getsockname()
    if isinstance(name, str):  # a unix socket
        return name, 0
    return name[0], name[1]


async def serve(
    app: App,
    listen: str,
    role: str,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    drain_seconds: float = 5.0,
    certfile: str = "",
    keyfile: str = "",
    ca_certs: str = "",
    require_client_cert: bool = False,
    limits: Limits | LiveLimits = DEFAULT_LIMITS,
    bind: str = "",
    announce: bool = True,
    task_status: Bound = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `listen` until `shutdown_trigger` returns, then drain.

    With `certfile` it serves HTTPS (an empty `keyfile`: the key is in `certfile`). With
    `ca_certs` too, a client certificate is verified against it: optional (a client
    without one is served -- the hub's API, whose clients are ordinary OpenAI clients) or,
    with `require_client_cert`, required at the handshake (the node, dialled by the hub).
    Prints the `listening on` line and reports the bound (host, port) to
    `task_status.started` once the socket listens. `limits` are the listener's defences
    (appliance/server/limits.py; `LiveLimits`: a reload's apply from then on). A socket or
    TLS file that cannot be used raises StartupError.
    """
    section = _SECTION.get(role, role.capitalize())
    host, port = parse_listen(listen, f"{section}__Listen")
    tls: ssl.SSLContext | None = None
    if certfile:
        try:
            tls = tls_context(certfile, keyfile, ca_certs, require_client_cert)
        except (OSError, ssl.SSLError) as e:
            names = "/".join(f"{section}__{k}" for k, v in (("TlsCert", certfile),
                                                            ("TlsKey", keyfile),
                                                            ("TlsCa", ca_certs)) if v)
            raise StartupError(f"{names}={certfile!r}{f', {keyfile!r}' if keyfile else ''}"
                               f"{f', {ca_certs!r}' if ca_certs else ''}: cannot load: "
                               f"{e.strerror or e}") from None
    try:
        sock = listening_socket(bind or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
    except OSError as e:
        raise StartupError(f"{section}__Listen={listen!r}: cannot listen: {e.strerror or e}"
                           ) from None
    settings = Settings(keep_alive=KEEP_ALIVE_SECONDS, drain=drain_seconds)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: serve_sockets(
            app, [sock], tls, live_limits(limits), settings,
            shutdown_trigger=shutdown_trigger or trio.sleep_forever, task_status=task_status))
        if not announce:  # a hub worker, or the hub's private socket: no line, no address
            task_status.started(("", 0))
            return
        h, p = _where(sock)
        scheme = "https" if tls is not None else "http"
        addr = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        print(f"appliance {role} listening on {scheme}://{addr}", file=sys.stderr, flush=True)
        task_status.started((h, p))
