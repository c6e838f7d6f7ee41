"""`/api/pull` and `/api/delete` as fleet operations (admin key), in Ollama's shapes.

Owns the fan-out of one pull or delete to every connected node whose engine manages its
own models (`ollama`, `sim`) -- or only `?node=NAME` -- through the node's
`POST /node/v1/pull` / `/node/v1/delete`; a model tied to an engine kind goes only to
nodes of that kind. `fan_out`: one task per node, at most NODES_AT_ONCE at a time (a pull
downloads gigabytes), outcomes kept in the order the nodes were asked. Pull progress meets
in one bounded channel the one writer drains to the client (a slow client slows the
pulls; no line is lost), Ollama's NDJSON with a `node` field; the last line is
`{"status": "success"}` only when every node succeeded, else an error naming the others;
either carries `nodes`. `"stream": false` answers that object once. A delete is a 200
`{"deleted": [...]}` when any node had the model, else 404 (none) or 502 (a node failed,
it may still hold it), with `nodes`. One audit event per operation. It must not change
the catalog: the nodes report their model lists within a heartbeat.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import msgspec
import trio

from appliance.bounds import CLEANUP_SECONDS, echo
from appliance.client.upstream import UpstreamError
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, bearer, read_body, send_json
from appliance.http.errors import ApiError, api_of
from appliance.http.lines import LineEncoder
from appliance.http.respond import send_api_error
from appliance.hub.decide import capable

if TYPE_CHECKING:
    from appliance.hub.fleet.nodes import NodeHandle
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

BODY_LIMIT = 64 * 1024
MANAGING_KINDS = ("ollama", "sim")
# A pull may download gigabytes; a node silent this long between two progress lines is lost.
PULL_READ_SECONDS = 600.0
DELETE_SECONDS = 60.0
# Nodes asked at once (a pull is a download of gigabytes); progress lines buffered.
NODES_AT_ONCE = 4
PULL_LINES_BUFFERED = 64
DELETED, NOT_FOUND = "deleted", "not found"
NDJSON = [(b"content-type", b"application/x-ndjson")]
_enc = LineEncoder()  # lines escaped: appliance/http/lines.py


class _Body(msgspec.Struct):
    model: str = ""
    name: str = ""
    stream: bool | None = None


def admin_ok(hub: Hub, scope: Scope) -> bool:
    key = hub.cfg.auth.admin_key
    return not key or hmac.compare_digest((bearer(scope) or "").encode(), key.encode())


def _targets(hub: Hub, node: str | None, model: str) -> list[NodeHandle]:
    spec = hub.control.core.spec(model)
    return [h for h in list(hub.registry.nodes.values())
            if h.connected and h.state is not None and h.kind() in MANAGING_KINDS
            and capable.serves(spec, h) and (node is None or h.name == node)]


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send, action: str) -> None:
    """`/api/pull` or `/api/delete`; a refusal is an ApiError, answered in Ollama's shape."""
    try:
        await _handle(hub, scope, receive, send, action)
    except ApiError as e:
        await send_api_error(send, api_of(scope["path"]), e)


async def _handle(hub: Hub, scope: Scope, receive: Receive, send: Send, action: str) -> None:
    want = "POST" if action == "pull" else "DELETE"
    if scope["method"] != want and not (action == "delete" and scope["method"] == "POST"):
        raise ApiError(405, "method_not_allowed", f"/api/{action} takes {want}")
    if not admin_ok(hub, scope):
        raise ApiError(401, "invalid_api_key", f"/api/{action} needs the admin key")
    try:
        req = msgspec.json.decode(await read_body(receive, BODY_LIMIT), type=_Body)
    except BodyTooLarge:
        raise ApiError(413, "body_too_large", "body too large") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ApiError(400, "invalid_request", f"invalid request: {e}") from None
    model = req.model or req.name
    node = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("node") or [None])[0]
    if not model:
        raise ApiError(400, "invalid_request", "model is required")
    targets = _targets(hub, node, model)
    spec = hub.control.core.spec(model)
    need = capable.engine_for(spec.engine, spec.source)
    if not targets and need and need not in MANAGING_KINDS:
        raise ApiError(501, "not_implemented",
                       f"model {echo(model)!r} is served by {need} engines, which do not "
                       f"{action} models: they read model files the operator puts in place")
    if not targets:
        if node:
            what = f"node {node!r} is not connected or its engine does not"
        else:
            what = "no connected node's engine does"
        raise ApiError(501, "not_implemented",
                       f"{what} {action} models (ollama engines do; llama.cpp and openai engines "
                       "read model files the operator puts in place)")
    hub.audit.event(f"model_{action}", model=model, nodes=[h.name for h in targets])
    body = _enc.encode({"model": model})
    if action == "delete":
        await _delete(hub, send, model, targets, body)
    else:
        await _pull(hub, send, model, targets, body, req.stream is not False)


Emit = Callable[[bytes], Awaitable[None]]
# One node's operation: (node, where its NDJSON lines go or None) -> its outcome.
NodeOp = Callable[["NodeHandle", Emit | None], Awaitable[str]]


async def fan_out(targets: Sequence[NodeHandle], op: NodeOp,
                  write: Emit | None = None) -> dict[str, str]:
    """Run `op` on every node, at most NODES_AT_ONCE at once; the lines they emit go,
    whole and as they come, through one bounded channel to `write` (None: no lines).
    Returns each node's outcome in the order the nodes were asked."""
    outcome: dict[str, str] = {h.name: "" for h in targets}
    limiter = trio.CapacityLimiter(NODES_AT_ONCE)
    lines_in, lines_out = trio.open_memory_channel[bytes](PULL_LINES_BUFFERED)

    async def one(h: NodeHandle, out: trio.MemorySendChannel[bytes]) -> None:
        async with out:
            async with limiter:
                outcome[h.name] = await op(h, out.send if write is not None else None)

    async with trio.open_nursery() as nursery:
        async with lines_in:
            for h in targets:
                nursery.start_soon(one, h, lines_in.clone())
        async with lines_out:
            async for line in lines_out:
                if write is not None:
                    await write(line)
    return outcome


async def _delete(hub: Hub, send: Send, model: str, targets: Sequence[NodeHandle],
                  body: bytes) -> None:
    async def op(h: NodeHandle, _emit: Emit | None) -> str:
        return await _delete_one(hub, h, model, body)

    outcome = await fan_out(targets, op)
    found = [name for name, what in outcome.items() if what == DELETED]
    failed = [name for name, what in outcome.items() if what not in (DELETED, NOT_FOUND)]
    if found:
        hub.control.forget(model)
        await send_json(send, 200, {"deleted": found, "nodes": outcome})
    elif failed:
        await send_json(send, 502, {"error": f"delete of {model} failed on {', '.join(failed)}",
                                    "nodes": outcome})
    else:
        await send_json(send, 404, {"error": f"model '{model}' not found", "nodes": outcome})


async def _delete_one(hub: Hub, h: NodeHandle, model: str, body: bytes) -> str:
    """DELETED, NOT_FOUND, or what went wrong on this node."""
    with trio.move_on_after(DELETE_SECONDS):
        resp = None
        try:
            resp = await hub.upstream.request("POST", h.url + "/node/v1/delete",
                                              [(b"content-type", b"application/json"),
                                               *h.auth_raw], body, DELETE_SECONDS)
            await resp.read()
            if resp.status_code == 200:
                return DELETED
            if resp.status_code == 404:
                return NOT_FOUND
            return f"node answered {resp.status_code}"
        except UpstreamError as e:
            log.warning("delete %s on %s failed: %s", model, h.name, e)
            return f"node lost during the delete: {e}"
        finally:
            if resp is not None:
                with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                    await resp.aclose()
    log.warning("delete %s on %s: no answer in %g s", model, h.name, DELETE_SECONDS)
    return f"no answer in {DELETE_SECONDS:g} s"


async def _pull(hub: Hub, send: Send, model: str, targets: Sequence[NodeHandle], body: bytes,
                stream: bool) -> None:
    async def op(h: NodeHandle, emit: Emit | None) -> str:
        _, error = await _pull_one(hub, h, body, emit)
        if error and emit is not None:
            await emit(_enc.encode({"error": error, "node": h.name}) + b"\n")
        return error or "success"

    async def write(line: bytes) -> None:
        await send({"type": "http.response.body", "body": line, "more_body": True})

    if stream:
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON})
    outcome = await fan_out(targets, op, write if stream else None)
    failed = [name for name, what in outcome.items() if what != "success"]
    last: dict[str, object] = ({"status": "success"} if not failed
                  else {"error": f"pull of {model} failed on {', '.join(failed)}"})
    last["nodes"] = outcome
    if stream:
        await send({"type": "http.response.body", "body": _enc.encode(last) + b"\n",
                    "more_body": False})
    else:
        await send_json(send, 200 if not failed else 502, last)


async def _pull_one(hub: Hub, h: NodeHandle, body: bytes, emit: Emit | None) -> tuple[int, str]:
    """(lines relayed, error or "") for one node; progress lines to `emit` when streaming."""
    n, buf, error = 0, b"", ""
    resp = None
    try:
        resp = await hub.upstream.request("POST", h.url + "/node/v1/pull",
                                          [(b"content-type", b"application/json"), *h.auth_raw],
                                          body, PULL_READ_SECONDS)
        async for chunk in resp.chunks():
            buf += chunk
            *whole, buf = buf.split(b"\n")
            for line in whole:
                n, error = await _relay_line(line, h.name, emit, n, error, resp.status_code)
        if buf.strip():
            n, error = await _relay_line(buf, h.name, emit, n, error, resp.status_code)
        if resp.status_code != 200 and not error:
            error = f"node answered {resp.status_code}"
    except UpstreamError as e:
        error = f"node lost during the pull: {e}"
    finally:
        if resp is not None:
            with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                await resp.aclose()
    return n, error


async def _relay_line(line: bytes, node: str, emit: Emit | None,
                      n: int, error: str, status: int) -> tuple[int, str]:
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return n, error
    if not isinstance(obj, dict):
        return n, error
    if "error" in obj or status != 200:
        return n, str(obj.get("error") or obj)
    if obj.get("status") == "success":
        return n, error  # the fleet's own success line comes last
    if emit is not None:
        await emit(_enc.encode({**obj, "node": node}) + b"\n")
    return n + 1, error
