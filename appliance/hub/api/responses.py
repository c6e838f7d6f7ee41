"""Stored responses: `POST /v1/responses` with the store, and `/v1/responses/{id}` routes.

Theory of operation: a create that asks nothing of the store (`store: false`, no
`previous_response_id`, no `conversation`, no `background`) goes to the router as it
came. Otherwise the hub takes the response's id (naming this hub) before it runs,
rebuilds `input` from the chain (hub/store/responses.py `history`) or the conversation
plus the request's own input, makes the chain's first id (or the conversation's) the
request's session key (`prompt_cache_key`, so the next turn lands where its cache is), and
hands the router that body. The answer goes to the client byte for byte; a copy (bounded)
is read as it passes, and once it is whole and a 200 it is recorded -- before its last
byte leaves, so a retrieve right after finds it. `background: true` is stored `queued`
and answered at once; the store's `Background` runs it as background work. Another key's
response is 404 `not_found`, like one that does not exist. A turn that continues a chain or
a conversation another hub holds is sent to that hub whole (hub/store/peers.py): it runs
there, where the history is, and its response is stored there.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.bounds import echo
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, read_body, replay, send_json
from appliance.http.errors import ApiError
from appliance.http.respond import send_api_error
from appliance.hub.api.objects import Caller, caller, find, listing, maker, page_ask, store_of
from appliance.hub.api.router import handle_inference
from appliance.hub.store import ids, peers
from appliance.hub.store import items as itemsmod
from appliance.hub.store.db import Obj
from appliance.hub.store.responses import history, record
from appliance.hub.translate.responses import HUB_FIELDS

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

log = logging.getLogger("appliance.hub.api.responses")

# The copy of an answer read for the store: a long answer with its events is a few MiB.
MAX_KEPT = 16 * 1024 * 1024
FINAL_EVENTS = (b"response.completed", b"response.incomplete")


async def create(hub: Hub, scope: Scope, receive: Receive, send: Send) -> None:
    """POST /v1/responses (with a store; without one the router answers it alone)."""
    try:
        body = await read_body(receive, hub.cfg.hub.max_body_bytes)
    except BodyTooLarge:
        # The router answers it in its own words (413) from what is left of the body.
        await handle_inference(hub.routing, scope, replay(b"x" * (hub.cfg.hub.max_body_bytes + 1),
                                                   receive), send, "openai")
        return
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        await handle_inference(hub.routing, scope, replay(body, receive), send, "openai")
        return
    had_fields = obj.pop(HUB_FIELDS, None) is not None
    keep = obj.get("store", True) is not False
    prev, conv, bg = obj.get("previous_response_id"), obj.get("conversation"), obj.get(
        "background") is True
    if not keep and prev is None and conv is None and not bg:
        if had_fields:
            body = msgspec.json.encode(obj)
        await handle_inference(hub.routing, scope, replay(body, receive), send, "openai")
        return
    holder, oid = _chain_elsewhere(hub, scope, prev, conv)
    if holder is not None:  # the chain lives on another hub: that hub runs this turn
        try:
            caller(hub, scope)  # a caller this hub knows, before it asks another
            await peers.forward(hub, scope, replay(body, receive), send, oid, holder)
        except ApiError as e:
            await send_api_error(send, "openai", e)
        return
    try:
        plan = await _plan(hub, caller(hub, scope), obj, keep, prev, conv, bg)
    except ApiError as e:
        await send_api_error(send, "openai", e)
        return
    store = store_of(hub)
    if bg:
        await send_json(send, 200, await _queue(hub, plan))
        return
    tee = _Tee(send, bool(obj.get("stream")))

    async def finish() -> None:
        resp = tee.response()
        if resp is None:
            return
        try:
            await record(store, plan.owner, plan.rid, resp, plan.prev, plan.own, plan.conv,
                         plan.keep, hub.cfg.store.response_days)
        except (ApiError, OSError) as e:
            log.warning("response %s answered but not stored: %s", plan.rid, e)

    tee.on_end = finish
    await handle_inference(hub.routing, scope, replay(msgspec.json.encode(plan.body), receive),
                           tee.send, "openai")


def _chain_elsewhere(hub: Hub, scope: Scope, prev: Any, conv: Any) -> tuple[str | None, str]:
    """The other hub holding the response or conversation this turn continues, and its id
    (hub/store/peers.py)."""
    conv_id = conv.get("id") if isinstance(conv, dict) else conv
    for oid, prefix in ((prev, "resp_"), (conv_id, "conv_")):
        if isinstance(oid, str):
            holder = peers.elsewhere(hub, scope, oid, prefix)
            if holder is not None:
                return holder, oid
    return None, ""


class _Plan:
    def __init__(self, owner: str, rid: str, body: dict[str, Any], own: list[dict[str, Any]],
                 prev: str | None, conv: str | None, keep: bool) -> None:
        self.owner, self.rid, self.body, self.own = owner, rid, body, own
        self.prev, self.conv, self.keep = prev, conv, keep


async def _plan(hub: Hub, c: Caller, obj: dict[str, Any], keep: bool, prev: Any, conv: Any,
                bg: bool) -> _Plan:
    store = store_of(hub)
    owner = maker(c)
    if prev is not None and not isinstance(prev, str):
        raise ApiError(400, "invalid_request", "'previous_response_id' must be a string",
                       param="previous_response_id")
    conv_id = conv.get("id") if isinstance(conv, dict) else conv
    if conv_id is not None and not isinstance(conv_id, str):
        raise ApiError(400, "invalid_request", "'conversation' is an id or {\"id\": ...}",
                       param="conversation")
    if prev and conv_id:
        raise ApiError(400, "invalid_request", "previous_response_id and conversation cannot "
                       "both be given", param="conversation")
    if bg and obj.get("stream"):
        raise ApiError(400, "invalid_request", "background responses are polled here, not "
                       "streamed: leave stream off", param="stream")
    if bg and not keep:
        raise ApiError(400, "invalid_request", "a background response is stored: store must "
                       "be true", param="background")
    own = itemsmod.normalize(obj.get("input"))
    past: list[dict[str, Any]] = []
    session = None
    if prev:
        past, session = await history(store, owner, prev)
    if conv_id:
        await find(hub, store, c, "conversation", "conv_", conv_id)
        past, _ = await store.run(store.db.items, conv_id, None, itemsmod.MAX_HISTORY, False)
        session = conv_id
    if len(past) + len(own) > itemsmod.MAX_HISTORY:
        raise ApiError(400, "invalid_request", f"the rebuilt input is over "
                       f"{itemsmod.MAX_HISTORY} items")
    rid = ids.new("resp_", hub.cfg.hub_name())
    body = {k: v for k, v in obj.items() if k not in ("previous_response_id", "conversation",
                                                       "store", "background")}
    body["input"] = past + own
    body.setdefault("prompt_cache_key", session or rid)
    body[HUB_FIELDS] = {"id": rid, "previous_response_id": prev, "store": keep,
                        "background": bg, "conversation": {"id": conv_id} if conv_id else None}
    if keep:
        await store.check_quota(owner)
        store.room(len(body.get("input") or ()) * 256)  # about what its items will take
    return _Plan(owner, rid, body, own, prev, conv_id, keep)


async def _queue(hub: Hub, plan: _Plan) -> dict[str, Any]:
    store = store_of(hub)
    now = int(time.time())
    resp: dict[str, Any] = {
            "id": plan.rid, "object": "response", "created_at": now, "status": "queued",
            "background": True, "model": plan.body.get("model"), "output": [], "error": None,
            "incomplete_details": None, "previous_response_id": plan.prev, "store": True,
            "conversation": {"id": plan.conv} if plan.conv else None, "usage": None,
            "metadata": plan.body.get("metadata") or {}}
    o = Obj(plan.rid, "response", plan.owner, now, now + hub.cfg.store.response_days * 86400,
            0, "queued", {"response": resp, "previous_response_id": plan.prev,
                          "request": msgspec.json.encode(plan.body).decode(),
                          "conversation": plan.conv})
    o.bytes = len(o.data["request"])
    await store.put(o, [(i["id"], i) for i in plan.own])
    if hub.background is None:
        raise ApiError(501, "store_disabled", "this hub runs no background responses")
    hub.background.start(o)
    return resp


class _Tee:
    """The client's `send`, with a bounded copy of a 200 answer kept for the store."""

    def __init__(self, send: Send, stream: bool) -> None:
        self.inner, self.stream = send, stream
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.on_end: Any = None

    async def send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
        elif msg["type"] == "http.response.body" and self.status == 200:
            chunk = msg.get("body", b"")
            self.size += len(chunk)
            if self.size <= MAX_KEPT:
                self.parts.append(chunk)
            if not msg.get("more_body") and self.on_end is not None:
                end, self.on_end = self.on_end, None
                await end()
        await self.inner(msg)

    def response(self) -> dict[str, Any] | None:
        if self.size > MAX_KEPT or self.status != 200:
            return None
        data = b"".join(self.parts)
        try:
            if not self.stream:
                obj = msgspec.json.decode(data)
                return obj if isinstance(obj, dict) else None
            last = None
            for event in data.split(b"\n\n"):
                if any(b"event: " + k in event for k in FINAL_EVENTS):
                    for line in event.split(b"\n"):
                        if line.startswith(b"data: "):
                            last = msgspec.json.decode(line[6:]).get("response")
            return last if isinstance(last, dict) else None
        except msgspec.DecodeError:
            return None


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send, c: Caller,
                 rest: list[str]) -> None:
    """GET/DELETE /v1/responses/{id}, GET .../input_items, POST .../cancel."""
    store = store_of(hub)
    method = scope["method"]
    if not rest:
        raise ApiError(404, "not_found", "no such route")
    o = await find(hub, store, c, "response", "resp_", rest[0])
    if len(rest) == 1 and method == "GET":
        await send_json(send, 200, o.data["response"])
    elif len(rest) == 1 and method == "DELETE":
        if hub.background is not None:
            hub.background.cancel(o.id)
        await store.remove(o)
        await send_json(send, 200, {"id": o.id, "object": "response", "deleted": True})
    elif len(rest) == 2 and rest[1] == "input_items" and method == "GET":
        ask = page_ask(scope)
        data, more = await store.run(store.db.items, o.id, ask.after, ask.limit,
                                     ask.newest_first)
        await send_json(send, 200, listing(data, more))
    elif len(rest) == 2 and rest[1] == "cancel" and method == "POST":
        if not o.data["response"].get("background"):
            raise ApiError(400, "invalid_request", "only a background response can be cancelled")
        if o.state in ("queued", "in_progress") and hub.background is not None:
            hub.background.cancel(o.id)
            resp = {**o.data["response"], "status": "cancelled"}
        else:
            resp = o.data["response"]
        await send_json(send, 200, resp)
    else:
        raise ApiError(404, "not_found",
                       f"no route {method} /v1/responses/{echo('/'.join(rest))}")
