"""The hub's HTTP surface: one ASGI callable dispatching by method and path.

Theory of operation: a dict lookup picks the handler; anything unknown is answered in the
shape of the API its path belongs to (/v1 -> OpenAI, else Ollama's `{"error"}`), 404 for
an unknown route and 405 for a known route with the wrong method. Inference goes to the
router; the information routes are derived from live state by status.py; /admin/ goes to
admin.py once the admin key is checked. Nothing here blocks or holds state of its own.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from appliance import __version__
from appliance.bounds import echo_path
from appliance.http.asgi import (
    App,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    bearer,
    read_body,
    send_json,
    send_text,
)
from appliance.http.errors import ApiError, api_of
from appliance.http.respond import send_api_error
from appliance.hub.api import responses, status, stored, ui
from appliance.hub.api import routes as apiroutes
from appliance.hub.api.anthropic_models import anthropic_models, is_anthropic
from appliance.hub.api.router import allowed, authenticate, handle_inference
from appliance.hub.cluster.etcd import EtcdError
from appliance.hub.fleet import announce
from appliance.observe.metricsapp import render
from appliance.wire import announce_decoder

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

# The inference routes, each with its API (`errors.api_of`, the one path -> API map).
INFERENCE = {p: api_of(p) for p in (
    "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/api/chat", "/api/generate",
    "/api/embed", "/api/embeddings", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses")}
GETS = {"/health", "/api/status", "/metrics", "/v1/models", "/api/tags", "/api/ps"}
# A LAN resolver answers in milliseconds; one that takes 5 s is not one to trust a node to.
RESOLVE_SECONDS = 5.0
# Announcements are tiny; anything bigger is not a node.
ANNOUNCE_MAX_BYTES = 64 * 1024


async def _error(send: Send, path: str, status: int, code: str, message: str,
                 headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    await send_api_error(send, api_of(path), ApiError(status, code, message), headers)


def make_app(hub: Hub) -> App:
    async def rest(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        if path in INFERENCE:
            await _error(send, path, 405, "method_not_allowed", f"{echo_path(path)} takes POST")
            return
        if await apiroutes.handle(hub, scope, receive, send):
            return
        if await stored.handle(hub, scope, receive, send):
            return
        if path in GETS:
            if method not in ("GET", "HEAD"):
                await _error(send, path, 405, "method_not_allowed", f"{echo_path(path)} takes GET")
                return
            await _get(hub, scope, send, path)
            return
        if path == "/api/nodes/announce":
            if method != "POST":
                await _error(send, path, 405, "method_not_allowed", f"{echo_path(path)} takes POST")
                return
            await _announce(hub, scope, receive, send)
            return
        if path.startswith("/admin/"):
            if not _admin_ok(hub, scope):
                await _error(send, "/v1/", 401, "invalid_api_key", "the admin key is required")
                return
            from appliance.hub.api import admin

            await admin.handle(hub, scope, receive, send)
            return
        if await ui.handle(hub, scope, send, lambda: _admin_ok(hub, scope)):
            return
        await _error(send, path, 404, "not_found", f"no route {method} {echo_path(path)}")

    others = apiroutes.with_request_id(rest)
    routing = hub.routing

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        # An inference POST goes straight to the router, which makes its request id (it
        # also forwards and audits it); every other answer gets one from the wrapper.
        if scope.get("method") == "POST":
            api = INFERENCE.get(scope["path"])
            if api is not None:
                if scope["path"] == "/v1/responses" and hub.store is not None:
                    await responses.create(hub, scope, receive, send)  # stored, chained
                else:
                    await handle_inference(routing, scope, receive, send, api)
                return
        await others(scope, receive, send)

    origins = [o.strip() for o in hub.cfg.hub.cors_origins.split(",") if o.strip()]
    return apiroutes.with_cors(app, origins)


def _admin_ok(hub: Hub, scope: Scope) -> bool:
    key = hub.cfg.auth.admin_key
    if not key:
        return True
    given = bearer(scope) or ""
    return hmac.compare_digest(given.encode(), key.encode())


async def _get(hub: Hub, scope: Scope, send: Send, path: str) -> None:
    if path == "/health":
        await send_json(send, 200, {"status": "ok", "version": __version__})
        return
    if path in ("/api/status", "/metrics"):
        if not _admin_ok(hub, scope):
            await _error(send, "/v1/", 401, "invalid_api_key", "the admin key is required")
            return
        if path == "/metrics":
            await send_text(send, 200, render(hub.metrics_registry, hub.before_scrape),
                            CONTENT_TYPE_LATEST.encode())
        else:
            await send_json(send, 200, status.status_payload(hub))
        return
    try:
        client = authenticate(hub.cfg.auth, bearer(scope))
    except ApiError as e:
        await _error(send, path, e.status, e.code, e.message)
        return

    def may(model: str) -> bool:
        return allowed(client, model)

    if path == "/v1/models":
        listed = status.openai_models(hub, may)
        if is_anthropic(scope["headers"]):  # Anthropic's shape for its clients
            try:
                page = anthropic_models(listed["data"], scope.get("query_string") or b"")
            except ApiError as e:
                await send_api_error(send, "anthropic", e)
                return
            await send_json(send, 200, page)
        else:
            await send_json(send, 200, listed)
    elif path == "/api/tags":
        await send_json(send, 200, status.ollama_tags(hub, may))
    else:
        await send_json(send, 200, status.ollama_ps(hub, may))


async def _announce(hub: Hub, scope: Scope, receive: Receive, send: Send) -> None:
    source = (scope.get("client") or ("unknown", 0))[0]
    ann = None
    try:
        announce.check_bearer(hub.cfg.auth, bearer(scope) or "")
        try:
            body = await read_body(receive, ANNOUNCE_MAX_BYTES)
            ann = announce_decoder.decode(body)
        except BodyTooLarge:
            raise ApiError(413, "body_too_large", "announcement too large") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ApiError(400, "invalid_request",
                           f"bad announcement: {announce.cut(str(e))}") from None
        except RecursionError:
            raise ApiError(400, "invalid_request", "bad announcement: nested too deeply") from None
        proven = announce.authorize(hub.cfg.auth, bearer(scope) or "", ann.name)
        host, _port = announce.check_shape(ann.name, ann.url)
        existing = hub.registry.nodes.get(ann.name)
        announce.check_identity(existing, ann.url, proven, len(hub.registry.nodes),
                                hub.cfg.hub.max_nodes)
        if existing is None or existing.url != ann.url.rstrip("/"):
            announce.check_addresses(host, await _resolve(host), hub.cfg.hub.node_networks)
    except ApiError as e:
        if e.status in (401, 409, 403):
            name = announce.cut(ann.name, 63) if ann is not None else ""
            log.warning("announcement refused from %s (name %r): %s", source, name, e.message)
            hub.audit.event("node_refused", node=name, source=source, code=e.code, reason=e.message)
        # The OpenAI shape, so the code (node_name_taken ...) is in the body for the node's log.
        await _error(send, "/v1/", e.status, e.code, e.message, e.headers())
        return
    fresh = ann.name not in hub.registry.nodes
    hub.add_node(ann.name, ann.url, static=False)
    if (cluster := getattr(hub, "cluster",
                           None)) is not None:  # every hub dials a node that announced to one
        try:
            await cluster.announced(ann.name, ann.url, fresh)
        except EtcdError as e:
            log.warning("node %s announced, not shared with the other hubs: etcd: %s", ann.name, e)
    await send_json(send, 200, {"ok": True, "name": ann.name})


async def _resolve(host: str) -> list[str]:
    """The addresses `host` resolves to (an IP literal: itself); [] when it does not resolve
    within RESOLVE_SECONDS."""
    infos = []
    with trio.move_on_after(RESOLVE_SECONDS):
        try:
            infos = await trio.socket.getaddrinfo(host, None, type=trio.socket.SOCK_STREAM)
        except OSError:
            return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))
