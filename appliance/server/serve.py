"""How every role serves its ASGI app: bind, say where, accept, shed, drain.

Theory of operation: `serve` binds the listener (a `HOST:PORT`, or an inherited socket
`fd://N`, or `unix:PATH` -- the hub's workers), loads the TLS files when given (refused
with one line naming the variable when they cannot be used), prints the one
`appliance <role> listening on http://HOST:PORT` line the contract promises, and hands
the bound (host, port) to `task_status.started` only once the socket listens. TLS offers
only HTTP/1.1 (ALPN `http/1.1`); a client that asks for h2 falls back.

`serve_sockets` is the accept loop: one appliance/server/connection.py `Conn` per
connection, plain or TLS alike (a `TlsTransport`, its handshake part of the head
deadline). It owns:
- The connection bound: at most `max_connections` open. At the bound, a new client takes
  the place of the oldest connection that serves no request (idle, or still trickling its
  head or handshake: `Shed`); when every one is serving, the next waits in the kernel's
  backlog (no fd here).
- The drain: once `shutdown_trigger` returns, the listening sockets close, idle
  connections close at once, and those serving a request have `drain` seconds to finish.
- A reload (`LiveLimits.set`): a raised bound lets waiting accepts through at once, a
  lowered one closes nothing; the body budget follows.
Why our own server and not hypercorn's: docs/architecture.md, "The HTTP stack".
"""

from __future__ import annotations

import errno
import logging
import math
import os
import socket
import ssl
import stat
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from appliance.config import parse_listen
from appliance.http.asgi import App
from appliance.net.transport import TlsTransport, Transport, nodelay
from appliance.server.connection import Conn, Shared
from appliance.server.limits import Limits, LiveLimits, live_limits
from appliance.server.receive import Budget
from appliance.server.send import hangups

DEFAULT_LIMITS = Limits()

# Connections the kernel holds for us before we accept them: a burst of clients
# connecting at once (1,000 in bench/soak.py) overran 100; the kernel caps it at
# net.core.somaxconn (4096 on current Linux).
LISTEN_BACKLOG = 4096
# The idle keep-alive bound between requests (nginx's keepalive_timeout default, 75 s).
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


# --- the accept loop ----------------------------------------------------------------------

log = logging.getLogger(__name__)

# errnos of accept() that mean "out of fds/memory now", as trio's serve_listeners lists them.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# errnos of accept() about the one connection that failed (trio ignores these too).
_ACCEPT_SKIP = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.ENETDOWN, errno.ENOPROTOOPT,
                errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                errno.ENETUNREACH}
# A connection whose handler does not end within the drain is cut; its close is this short.
CLOSE_SECONDS = 1.0


@dataclass(frozen=True)
class Settings:
    """What a listener is, beside its live limits."""

    keep_alive: float = 75.0  # idle seconds between requests (nginx's default too)
    max_head: int = 16 * 1024  # a request head's bytes (hypercorn's h11_max_incomplete_size)
    max_requests: int = 1000  # per connection, then `connection: close`
    drain: float = 5.0  # seconds for requests in flight once the listener stops


class Shed:
    """At `max_connections`, a new client takes the place of the oldest connection that is
    not serving a request (idle, or still sending its head): otherwise clients that only
    trickle head bytes would make every new one wait out their head deadlines."""

    # One warning per minute at most while the listener sheds.
    LOG_EVERY = 60.0

    def __init__(self) -> None:
        self.count = 0
        self._logged = -math.inf

    def one(self, live: dict[Conn, None], limit: int) -> bool:
        for s in live:
            if not s.in_request:
                del live[s]
                s.cancel.cancel()
                self.count += 1
                now = trio.current_time()
                if now - self._logged >= self.LOG_EVERY:
                    self._logged = now
                    log.warning("%d connections open (the bound): closing the oldest that serve "
                                "no request to take new ones (%d so far)", limit, self.count)
                return True
        return False


async def serve_sockets(app: Callable[..., Awaitable[None]], sockets: list[socket.socket],
                        tls: ssl.SSLContext | None, live: LiveLimits, settings: Settings, *,
                        shutdown_trigger: Callable[[], Awaitable[Any]],
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on the listening `sockets` until `shutdown_trigger` returns, then drain
    (see the module's docstring)."""
    for lsock in sockets:
        lsock.setblocking(False)
        nodelay(lsock)  # small writes go out at once: a token is a write (accepted: inherited)
    budget = Budget(live.now.max_buffered_bytes)
    shared = Shared(app, live, budget, keep_alive=settings.keep_alive,
                    max_head=settings.max_head, max_requests=settings.max_requests,
                    hangups=hangups())
    # The connection bound, a bound a reload may move: a raised one lets waiting accepts
    # through at once (`lot`), a lowered one closes nothing.
    held = 0
    lot = trio.lowlevel.ParkingLot()
    conns: dict[Conn, None] = {}  # open connections, oldest first
    shed = Shed()

    def follow(new: Limits) -> None:  # a reload: what is not read per connection or request
        budget.limit = new.max_buffered_bytes
        lot.unpark_all()

    async def connection(sock: socket.socket) -> None:
        nonlocal held
        stall, rate = live.now.write_stall_seconds, live.now.min_read_bytes_per_second
        transport = (TlsTransport(sock, tls, server_side=True, stall=stall, min_rate=rate)
                     if tls is not None else Transport(sock, stall, rate))
        conn = Conn(transport, shared)
        conns[conn] = None
        try:
            with conn.cancel:
                await conn.run()
        finally:
            conns.pop(conn, None)
            held -= 1
            lot.unpark()
            with trio.move_on_after(CLOSE_SECONDS, shield=True):
                await transport.aclose()

    async def accept_loop(lsock: socket.socket, handlers: trio.Nursery) -> None:
        """Accept on a non-blocking listening socket (trio's accept rules), within the bound."""
        nonlocal held
        while True:
            await trio.lowlevel.wait_readable(lsock)
            try:
                sock, _ = lsock.accept()
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno in _ACCEPT_SKIP:
                    continue
                if e.errno not in _ACCEPT_CAPACITY:
                    raise
                log.error("accept failed (%s); pausing 100 ms",
                          errno.errorcode.get(e.errno, e.errno))
                await trio.sleep(0.1)
                continue
            try:  # (TCP_NODELAY: the listening socket's, inherited on Linux)
                if held >= live.now.max_connections:
                    shed.one(conns, live.now.max_connections)
                    while held >= live.now.max_connections:
                        await lot.park()
            except BaseException:
                sock.close()
                raise
            held += 1
            handlers.start_soon(connection, sock)

    with live.following(follow):
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as acceptors:
                    for lsock in sockets:
                        acceptors.start_soon(accept_loop, lsock, handlers)
                    task_status.started()
                    await shutdown_trigger()
                    acceptors.cancel_scope.cancel()
            finally:
                for lsock in sockets:
                    lsock.close()
                shared.terminating = True  # idle connections close now, busy ones after
                for c in list(conns):
                    if not c.in_request:
                        c.cancel.cancel()
                handlers.cancel_scope.deadline = trio.current_time() + settings.drain
                # Writes waiting on clients that do not read are shielded from that cancel:
                # they end at the same deadline, so the process exits within the drain.
                for c in list(conns):
                    c.transport.abort_by(handlers.cancel_scope.deadline)
