"""The client routes around inference: liveness, version, one model, show, CORS, and the
model-management routes the hub does not do.

Owns `handle(hub, scope, receive, send)`: answers the routes below and returns True, or
returns False and leaves the request to the app. It must not decide routing; what it
says about models comes from the registry and the control plane.
- `GET /`, `HEAD /`: "Ollama is running" (the Ollama CLI's liveness check); a browser
  (Accept: text/html) is sent to `/ui/`. `GET /api/version`: the Ollama API version.
- `GET /v1/models/{id}`: one model, or a 404 in OpenAI's shape.
- `POST /api/show`: forwarded to a node whose engine speaks Ollama and has the model; else
  answered from what the hub knows (details, context length, capabilities).
- `/api/pull`, `/api/delete`: fleet operations behind the admin key (modelops.py);
  `/api/copy`, `/create`, `/push`, `/blobs/*`: 501 in Ollama's shape, saying what instead.
- CORS (`Hub__CorsOrigins`): `with_cors` adds the headers and answers preflights;
  `with_request_id` makes sure every answer carries `x-request-id`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import msgspec
import trio

from appliance import __version__
from appliance.bounds import echo
from appliance.client.upstream import UpstreamError
from appliance.config import ClientConfig
from appliance.http.asgi import (
    App,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    bearer,
    header,
    read_body,
    send_json,
    send_text,
)
from appliance.http.errors import ApiError
from appliance.http.respond import send_api_error
from appliance.hub import translate
from appliance.hub.api import modelops, status
from appliance.hub.api.anthropic_models import anthropic_model, is_anthropic
from appliance.hub.api.request import request_id
from appliance.hub.api.router import allowed, authenticate
from appliance.hub.decide import capable
from appliance.hub.translate import OPENAI_ONLY

if TYPE_CHECKING:
    from appliance.hub.fleet.nodes import NodeHandle
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

# The Ollama API this hub implements (routes and fields of Ollama 0.12); clients that
# compare versions read this one.
OLLAMA_API_VERSION = "0.12.6"
# /api/show bodies are a model name; 64 KiB is generous.
SHOW_BODY_LIMIT = 64 * 1024
# A node's /api/show answer is metadata (the template, the license): bounded all the same.
SHOW_READ_SECONDS = 30.0
UNSUPPORTED = {
    "/api/copy": "copying models is not done through the hub; copy on the node's engine",
    "/api/create": "creating models is not done through the hub; create on the node's engine, "
                   "or define it with Models__N__Source",
    "/api/push": "pushing models is not done through the hub; push from the node's engine",
}
CORS_METHODS = b"GET, POST, HEAD, OPTIONS, DELETE"
# The headers the official SDKs send from a browser: the Anthropic JS SDK refuses to run
# in one unless it may send `anthropic-dangerous-direct-browser-access: true`.
CORS_HEADERS = (
    b"authorization, content-type, x-api-key, x-request-id, x-priority, anthropic-version, "
    b"anthropic-beta, anthropic-dangerous-direct-browser-access, openai-organization, "
    b"openai-project, x-stainless-os, x-stainless-lang, x-stainless-package-version, "
    b"x-stainless-runtime, x-stainless-runtime-version, x-stainless-arch, "
    b"x-stainless-retry-count, x-stainless-timeout, user-agent")


def _header(scope: Scope, name: bytes) -> str:
    return header(scope, name) or ""


def cors_origin(origins: list[str], scope: Scope) -> bytes | None:
    """The Access-Control-Allow-Origin value for this request, None: no CORS headers."""
    origin = _header(scope, b"origin")
    if not origin or not origins:
        return None
    if "*" in origins:
        return b"*"
    return origin.encode("latin-1") if origin in origins else None


def with_request_id(app: App) -> App:
    """Every answer carries `x-request-id`: the router sets it on inference answers (it also
    forwards and audits it; app.py sends those past this wrapper); this fills it in on
    every other one."""

    async def rid_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        rid: bytes | None = None

        async def send_rid(msg: dict[str, Any]) -> None:
            nonlocal rid
            if msg["type"] == "http.response.start":
                headers = msg.get("headers", [])
                if not any(k == b"x-request-id" for k, _ in headers):
                    rid = rid or request_id(scope["headers"]).encode()
                    msg = {**msg, "headers": [*headers, (b"x-request-id", rid)]}
            await send(msg)

        await app(scope, receive, send_rid)

    return rid_app


def with_cors(app: App, origins: list[str]) -> App:
    """The app, with CORS headers on its answers and OPTIONS preflights answered."""
    if not origins:
        return app

    async def cors_app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        allow = cors_origin(origins, scope)
        if scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method"):
            headers = [(b"content-length", b"0"), (b"vary", b"origin")]
            if allow is not None:
                headers += [(b"access-control-allow-origin", allow),
                            (b"access-control-allow-methods", CORS_METHODS),
                            (b"access-control-allow-headers", CORS_HEADERS),
                            (b"access-control-max-age", b"600")]
            await send({"type": "http.response.start", "status": 204 if allow is not None else 403,
                        "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        if allow is None:
            await app(scope, receive, send)
            return

        async def send_cors(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"access-control-allow-origin",
                                                                    allow),
                                          (b"access-control-expose-headers",
                                           b"x-request-id, retry-after"),
                                          (b"vary", b"origin")]}
            await send(msg)

        await app(scope, receive, send_cors)

    return cors_app


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send) -> bool:
    path, method = scope["path"], scope["method"]
    if path == "/":
        if method not in ("GET", "HEAD"):
            await send_api_error(send, "ollama", ApiError(405, "method_not_allowed", "/ takes GET"))
        elif "text/html" in _header(scope, b"accept"):
            await send({"type": "http.response.start", "status": 302,
                        "headers": [(b"location", b"/ui/"), (b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send_text(send, 200, b"Ollama is running", b"text/plain; charset=utf-8")
        return True
    if path == "/api/version":
        if method not in ("GET", "HEAD"):
            await send_api_error(send, "ollama", ApiError(405, "method_not_allowed",
                                                  "/api/version takes GET"))
        else:
            await send_json(send, 200, {"version": OLLAMA_API_VERSION,
                                        "appliance_version": __version__})
        return True
    if path.startswith("/v1/models/"):
        await _one_model(hub, scope, send, unquote(path[len("/v1/models/"):]))
        return True
    if path == "/api/show":
        await _show(hub, scope, receive, send)
        return True
    if path in ("/api/pull", "/api/delete"):
        await modelops.handle(hub, scope, receive, send, path[len("/api/"):])
        return True
    if path in UNSUPPORTED or path.startswith("/api/blobs/"):
        msg = UNSUPPORTED.get(path,
                              "blobs are not stored by the hub; send them to the node's engine")
        await send_api_error(send, "ollama", ApiError(501, "not_implemented", msg))
        return True
    return False


def _client(hub: Hub, scope: Scope) -> ClientConfig:
    return authenticate(hub.cfg.auth, bearer(scope))


async def _one_model(hub: Hub, scope: Scope, send: Send, model_id: str) -> None:
    api = "anthropic" if is_anthropic(scope["headers"]) else "openai"  # whose shape
    try:
        if scope["method"] not in ("GET", "HEAD"):
            raise ApiError(405, "method_not_allowed", "/v1/models/{id} takes GET")
        client = _client(hub, scope)
        resolved = translate.resolve(model_id, hub.control.known)[0]
        for m in status.openai_models(hub, lambda name: allowed(client, name))["data"]:
            if m["id"] == resolved:
                await send_json(send, 200, anthropic_model(m) if api == "anthropic" else m)
                return
        raise ApiError(404, "model_not_found", f"The model '{model_id}' does not exist")
    except ApiError as e:
        await send_api_error(send, api, e)


class _Show(msgspec.Struct):
    model: str = ""
    name: str = ""


async def _show(hub: Hub, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        if scope["method"] != "POST":
            raise ApiError(405, "method_not_allowed", "/api/show takes POST")
        client = _client(hub, scope)
        try:
            req = msgspec.json.decode(await read_body(receive, SHOW_BODY_LIMIT), type=_Show)
        except BodyTooLarge:
            raise ApiError(413, "body_too_large", "body too large for /api/show") from None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ApiError(400, "invalid_request", f"invalid request: {e}") from None
        except RecursionError:
            raise ApiError(400, "invalid_json",
                           "body is not valid JSON: nested too deeply") from None
        given = req.model or req.name
        model, known = translate.resolve(given, hub.control.known)
        if not given or not allowed(client, model) or not known:
            raise ApiError(404, "model_not_found", f"model '{echo(given)}' not found")
        body = await _show_from_node(hub, model)
        if body is None:
            body = msgspec.json.encode(_show_synth(hub, model))
        await send_json(send, 200, body)
    except ApiError as e:
        await send_api_error(send, "ollama", e)


def _capable(hub: Hub, model: str) -> list[NodeHandle]:
    """Connected nodes that list `model` and whose engine can serve it (capable.py): a sim
    that lists a llama.cpp model's name does not describe it."""
    spec = hub.control.core.spec(model)
    return [n for n in list(hub.registry.nodes.values())
            if n.connected and n.state is not None and n.state.model(model) is not None
            and capable.serves(spec, n)]


async def _show_from_node(hub: Hub, model: str) -> bytes | None:
    """A capable node with an Ollama-speaking engine that knows the model answers for it."""
    for node in _capable(hub, model):
        if node.kind() in OPENAI_ONLY:
            continue
        with trio.move_on_after(SHOW_READ_SECONDS):
            try:
                headers = [(b"content-type", b"application/json"), *node.auth_raw]
                resp = await hub.upstream.request("POST", node.url + "/api/show", headers,
                                                  msgspec.json.encode({"model": model}),
                                                  SHOW_READ_SECONDS)
                try:
                    data = await resp.read()
                finally:
                    await resp.aclose()
                if resp.status_code == 200:
                    return data
            except UpstreamError as e:
                log.info("show %s on %s failed: %s", model, node.name, e)
    return None


def _show_synth(hub: Hub, model: str) -> dict[str, Any]:
    """What the hub knows of a model on an OpenAI-only engine (a GGUF's header for llama.cpp)."""
    kinds = sorted({n.kind() for n in _capable(hub, model)} - {""})
    meta = status.model_meta(hub, model)
    family = (meta.family if meta is not None and meta.family else "") or (kinds[0] if kinds
                                                                           else "")
    info: dict[str, Any] = {"general.architecture": family}
    if meta is not None and meta.context_length:
        info[f"{family}.context_length"] = meta.context_length
    known = capable.model_capabilities(hub.control.core.spec(model), _capable(hub, model), model)
    caps = sorted(known) if known is not None else (
        ["embedding"] if "embed" in model else ["completion", "tools"])
    details = status.details(meta)
    details["family"] = family
    details["families"] = details["families"] or ([family] if family else None)
    return {"license": "",
            "modelfile": f"# served by appliance {__version__} on "
                         f"{', '.join(kinds) or 'no engine yet'}\n",
            "parameters": "", "template": "", "details": details, "model_info": info,
            "capabilities": caps,
            "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
