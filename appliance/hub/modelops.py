"""`/api/pull` and `/api/delete` as fleet operations (admin key), in Ollama's shapes.

Theory of operation: a pull goes to every connected node whose engine manages its own
models (`ollama`, `sim`) -- or only to `?node=NAME` -- through the node's `POST
/node/v1/pull`, at most PULL_PARALLEL nodes at once (each downloads the model: a bound
on the fleet's share of the uplink). Each node's pull is its own task; their progress
lines meet in one bounded channel that the one writer drains to the client (a slow client
slows the pulls, no line is lost or cut), as Ollama's NDJSON with a `node` field added; a
node that fails adds an `{"error", "node"}` line. The last line is `{"status":
"success"}` only when every node succeeded, else an error line naming the nodes that did
not; either carries `nodes`, each node's outcome ("success" or its error), in the order
the nodes were asked. `"stream": false` answers that object once at the end. A delete
asks the same nodes (`POST /node/v1/delete`) and is a 200 when any had the model, a 404
when none did. Each operation is one audit event. The nodes read their engine's model
list right after, so the hub's catalog follows within a heartbeat.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

import msgspec
import trio

from appliance.asgi import BodyTooLarge, Receive, Scope, Send, bearer, read_body, send_json
from appliance.hub.translate import engine_kind
from appliance.upstream import UpstreamError

if TYPE_CHECKING:
    from appliance.hub.nodes import NodeHandle
    from appliance.hub.run import Hub

log = logging.getLogger("appliance.hub.modelops")

BODY_LIMIT = 64 * 1024
MANAGING_KINDS = ("ollama", "sim")
# A pull may download gigabytes; a node silent this long between two progress lines is lost.
PULL_READ_SECONDS = 600.0
DELETE_SECONDS = 60.0
# Nodes pulling at once (a pull is a download of gigabytes); progress lines buffered.
PULL_PARALLEL = 4
PULL_LINES_BUFFERED = 64
NDJSON = [(b"content-type", b"application/x-ndjson")]
_enc = msgspec.json.Encoder()


class _Body(msgspec.Struct):
    model: str = ""
    name: str = ""
    stream: bool | None = None


def admin_ok(hub: Hub, scope: Scope) -> bool:
    key = hub.cfg.auth.admin_key
    return not key or hmac.compare_digest((bearer(scope) or "").encode(), key.encode())


def _targets(hub: Hub, node: str | None) -> list:
    return [h for h in list(hub.registry.nodes.values())
            if h.connected and h.state is not None and engine_kind(h.state) in MANAGING_KINDS
            and (node is None or h.name == node)]


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send, action: str) -> None:
    want = "POST" if action == "pull" else "DELETE"
    if scope["method"] != want and not (action == "delete" and scope["method"] == "POST"):
        await send_json(send, 405, {"error": f"/api/{action} takes {want}"})
        return
    if not admin_ok(hub, scope):
        await send_json(send, 401, {"error": f"/api/{action} needs the admin key"})
        return
    try:
        req = msgspec.json.decode(await read_body(receive, BODY_LIMIT), type=_Body)
    except BodyTooLarge:
        await send_json(send, 413, {"error": "body too large"})
        return
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        await send_json(send, 400, {"error": f"invalid request: {e}"})
        return
    model = req.model or req.name
    node = (parse_qs(scope.get("query_string", b"").decode("latin-1")).get("node") or [None])[0]
    targets = _targets(hub, node)
    if not model:
        await send_json(send, 400, {"error": "model is required"})
        return
    if not targets:
        if node:
            what = f"node {node!r} is not connected or its engine does not"
        else:
            what = "no connected node's engine does"
        await send_json(send, 501,
                        {"error": f"{what} {action} models (ollama engines do; llama.cpp and "
                                  "openai engines read model files the operator puts in place)"})
        return
    hub.audit.event(f"model_{action}", model=model, nodes=[h.name for h in targets])
    body = _enc.encode({"model": model})
    if action == "delete":
        await _delete(hub, send, model, targets, body)
    else:
        await _pull(hub, send, model, targets, body, req.stream is not False)


async def _delete(hub: Hub, send: Send, model: str, targets: list, body: bytes) -> None:
    found = []
    for h in targets:
        with trio.move_on_after(DELETE_SECONDS):
            try:
                resp = await hub.upstream.request("POST", h.url + "/node/v1/delete",
                                                  [(b"content-type", b"application/json"),
                                                   *h.auth_raw],
                                                  body, DELETE_SECONDS)
                await resp.read()
                await resp.aclose()
                if resp.status_code == 200:
                    found.append(h.name)
            except UpstreamError as e:
                log.warning("delete %s on %s failed: %s", model, h.name, e)
    if found:
        hub.control.forget(model)
        await send_json(send, 200, {"deleted": found})
    else:
        await send_json(send, 404, {"error": f"model '{model}' not found"})


async def _pull(hub: Hub, send: Send, model: str, targets: list, body: bytes, stream: bool) -> None:
    outcome: dict[str, str] = {h.name: "" for h in targets}  # ask order, filled as they end
    limiter = trio.CapacityLimiter(PULL_PARALLEL)
    lines_in, lines_out = trio.open_memory_channel[bytes](PULL_LINES_BUFFERED)

    async def one(h: NodeHandle, out: trio.MemorySendChannel[bytes]) -> None:
        async with out:
            async with limiter:
                _, error = await _pull_one(hub, h, body, out.send if stream else None)
            outcome[h.name] = error or "success"
            if error and stream:
                await out.send(_enc.encode({"error": error, "node": h.name}) + b"\n")

    if stream:
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON})
    async with trio.open_nursery() as nursery:
        async with lines_in:
            for h in targets:
                nursery.start_soon(one, h, lines_in.clone())
        async with lines_out:
            async for line in lines_out:
                await send({"type": "http.response.body", "body": line, "more_body": True})
    failed = [name for name, what in outcome.items() if what != "success"]
    last: dict = ({"status": "success"} if not failed
                  else {"error": f"pull of {model} failed on {', '.join(failed)}"})
    last["nodes"] = outcome
    if stream:
        await send({"type": "http.response.body", "body": _enc.encode(last) + b"\n",
                    "more_body": False})
    else:
        await send_json(send, 200 if not failed else 502, last)


async def _pull_one(hub: Hub, h: NodeHandle, body: bytes,
                    emit: Callable[[bytes], Awaitable[None]] | None) -> tuple[int, str]:
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
            with trio.move_on_after(1, shield=True):
                await resp.aclose()
    return n, error


async def _relay_line(line: bytes, node: str, emit: Callable[[bytes], Awaitable[None]] | None,
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
