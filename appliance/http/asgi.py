"""The small ASGI toolkit the hub, the node and the sim server share, and how they serve.

Theory of operation: each of our servers is a plain ASGI callable dispatching on
(method, path) by hand -- no framework, because the hot path is one dict lookup and a
byte copy. This module owns reading a bounded request body, writing JSON and streamed
responses, and `serve`, which binds through hypercorn's trio worker, prints the one
`appliance <role> listening on http://HOST:PORT` line the contract promises, and hands
the bound (host, port) to `task_status.started` only once the socket listens.
"""

from __future__ import annotations

import logging
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio
from hypercorn.config import Config as HyperConfig

from appliance.config import parse_listen
from appliance.http.keys import request_key
from appliance.server import hyperfix
from appliance.server.listener import Limits, LiveLimits, live_limits, serve_guarded

hyperfix.apply()  # close a connection as soon as its peer has (hyperfix.py)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[..., Awaitable[None]]  # an ASGI app: await app(scope, receive, send)

_json = msgspec.json.Encoder()
JSON_HEADERS = [(b"content-type", b"application/json")]


DEFAULT_LIMITS = Limits()

# Connections the kernel holds for us before we accept them (see serve).
LISTEN_BACKLOG = 4096


class BodyTooLarge(Exception):
    pass


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


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of a request header (name in lower case), or None."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    for k, v in headers:
        if k == name:
            return v.decode("latin-1")
    return None


def bearer(scope: Scope) -> str | None:
    """The key from `Authorization: Bearer KEY`, else `x-api-key`."""
    return request_key(scope["headers"])


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge past `limit` bytes."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise trio.BrokenResourceError("client went away")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = obj if isinstance(obj, bytes) else _json.encode(obj)
    await send({"type": "http.response.start", "status": status, "headers": JSON_HEADERS + (headers
                                                                                            or [])})
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str | bytes,
                    content_type: bytes = b"text/plain; charset=utf-8") -> None:
    body = text.encode() if isinstance(text, str) else text
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type",
                                                                              content_type)]})
    await send({"type": "http.response.body", "body": body})


# What `serve` hands to `nursery.start`: the bound (host, port).
Bound = trio.TaskStatus[tuple[str, int]]


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
    (appliance/server/listener.py; `LiveLimits`: a reload's apply from then on). A socket or TLS
    file that cannot be used raises StartupError.
    """
    section = _SECTION.get(role, role.capitalize())
    host, port = parse_listen(listen, f"{section}__Listen")
    cfg = HyperConfig()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    if bind:  # hypercorn's own forms: an inherited socket (fd://N) or unix:PATH (hub/workers.py)
        cfg.bind = [bind]
    cfg.graceful_timeout = drain_seconds
    cfg.accesslog = None
    # hypercorn's own "Running on" line duplicates ours; keep its warnings and errors.
    errorlog = logging.getLogger(f"appliance.{role}.http")
    errorlog.setLevel(logging.WARNING)
    cfg.errorlog = errorlog
    cfg.keep_alive_timeout = 75
    limits = live_limits(limits)
    cfg.ssl_handshake_timeout = limits.now.header_read_seconds
    # Body events queued for an app that is not reading yet: 4 x 64 KiB reads a connection,
    # then TCP backpressure (hypercorn's default is 10).
    cfg.max_app_queue_size = 4
    # hypercorn's 100 is overrun by a burst of clients connecting at once (1,000 in
    # bench/soak.py: a third reset before they were accepted); the kernel caps it at
    # net.core.somaxconn (4096 on current Linux).
    cfg.backlog = LISTEN_BACKLOG
    if certfile:
        cfg.certfile = certfile
        cfg.keyfile = keyfile or certfile
        if ca_certs:
            cfg.ca_certs = ca_certs
            cfg.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL

    if certfile:
        try:
            cfg.create_ssl_context()
        except (OSError, ssl.SSLError) as e:
            names = "/".join(f"{section}__{k}" for k, v in (("TlsCert", certfile), ("TlsKey",
                                                                                    keyfile),
                                                           ("TlsCa", ca_certs)) if v)
            raise StartupError(f"{names}={certfile!r}{f', {keyfile!r}' if keyfile else ''}"
                               f"{f', {ca_certs!r}' if ca_certs else ''}: cannot load: "
                               f"{e.strerror or e}") from None

    async def _serve(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                     ) -> None:
        await serve_guarded(http_only(app), cfg, limits, shutdown_trigger=shutdown_trigger
                            or trio.sleep_forever,
                            task_status=task_status)

    async with trio.open_nursery() as nursery:
        try:
            binds = await nursery.start(_serve)
        except OSError as e:
            raise StartupError(
                f"{section}__Listen={listen!r}: cannot listen: {e.strerror or e}") from None
        if not announce:  # a hub worker, or the hub's private socket: no line, no address
            task_status.started(("", 0))
            return
        scheme, _, addr = binds[0].partition("://")
        h, _, p = addr.rpartition(":")
        print(f"appliance {role} listening on {scheme}://{addr}", file=sys.stderr, flush=True)
        task_status.started((h.strip("[]"), int(p)))


async def handle_lifespan(receive: Receive, send: Send) -> None:
    """Answer hypercorn's lifespan messages; our apps do their setup in the nursery."""
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def http_only(app: App) -> App:
    """Our apps see only `http` scopes: lifespan is answered here (setup happens in the
    nursery), anything else (websocket) is ignored."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await handle_lifespan(receive, send)

    return wrapped
