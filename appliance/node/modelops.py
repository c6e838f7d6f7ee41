"""`POST /node/v1/pull` and `POST /node/v1/delete`: Ollama's own model management, on the
engine this node fronts, for the hub's fleet-wide `/api/pull` and `/api/delete`.

Theory of operation: only engines that manage models themselves can pull or delete
(`ollama`, and the `sim` that imitates it); others answer 501 with what to do instead. The
body (`{"model": ...}`) goes to the engine's `/api/pull` (streamed NDJSON progress, relayed
chunk by chunk) or `DELETE /api/delete`, and the engine's answer comes back as it is.
After either, the engine's model list is read again, so the node's state (and the hub's
catalog) shows the change at once rather than at the next poll.
"""

from __future__ import annotations

import logging

import msgspec
import trio

from appliance.bounds import CLEANUP_SECONDS
from appliance.client.upstream import Pool, UpstreamError
from appliance.http.asgi import BodyTooLarge, Receive, Send, read_body
from appliance.http.errors import ApiError
from appliance.http.lines import escape_breaks
from appliance.http.respond import send_api_error
from appliance.node.engines.base import Engine, EngineError, redacted
from appliance.node.engines.ollama import POLL_ERRORS, PolledEngine
from appliance.node.proxy import NODE_API

log = logging.getLogger(__name__)

# A pull/delete body is a model name and a flag or two.
BODY_LIMIT = 64 * 1024
# Engines whose own API pulls and deletes models (DESIGN 6).
MANAGING_KINDS = ("ollama", "sim")
# Reading the model list again after a change: the engine answers from memory.
REFRESH_SECONDS = 10.0


class _Body(msgspec.Struct):
    model: str = ""
    name: str = ""


async def handle(engine: Engine, pool: Pool, read_seconds: float, receive: Receive, send: Send,
                 action: str) -> None:
    """`action` on `engine`, through the node's engine `pool`, each read bounded by
    `read_seconds` (Node__UpstreamReadSeconds)."""
    # ollama and sim: polled engines with the URL of an Ollama API
    if engine.kind not in MANAGING_KINDS or not isinstance(engine, PolledEngine) or not engine.url:
        await send_api_error(send, NODE_API, ApiError(
            501, "not_implemented", f"a {engine.kind or 'missing'} engine does not {action} "
            "models; put the model file where the engine reads it"))
        return
    try:
        body = await read_body(receive, BODY_LIMIT)
        req = msgspec.json.decode(body, type=_Body)
        if not (req.model or req.name):
            raise ApiError(400, "invalid_request", "model is required")
    except BodyTooLarge:
        await send_api_error(send, NODE_API, ApiError(413, "body_too_large", "body too large"))
        return
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        await send_api_error(send, NODE_API,
                             ApiError(400, "invalid_request", f"invalid request: {e}"))
        return
    except ApiError as e:
        await send_api_error(send, NODE_API, e)
        return
    method, path = ("POST", "/api/pull") if action == "pull" else ("DELETE", "/api/delete")
    resp = None
    try:
        resp = await pool.request(method, engine.url + path,
                                  [(b"content-type", b"application/json")], body, read_seconds)
        ctype = resp.headers.get("content-type", "application/json").encode("latin-1")
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [(b"content-type", ctype)]})
        async for chunk in resp.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        log.info("node: %s %s on the engine: %s", action, req.model or req.name, resp.status_code)
        with trio.move_on_after(REFRESH_SECONDS):
            try:
                await engine.refresh()
            except (*POLL_ERRORS,
                    EngineError) as e:  # the next poll tells; this only made it sooner
                log.info("node: reading the model list after %s failed: %s", action, e)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except UpstreamError as e:
        log.warning("node: %s on the engine at %s failed: %s", action, engine.url, e)
        why = redacted(f"the engine failed: {e}", engine.url)  # the client reads no address
        if resp is None:
            await send_api_error(send, NODE_API, ApiError(502, "engine_failed", why))
        else:
            await send({"type": "http.response.body",
                        "body": escape_breaks(msgspec.json.encode({"error": why})) + b"\n",
                        "more_body": False})
    finally:
        if resp is not None:
            with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                await resp.aclose()
