"""OpenAI's Conversations API on the store: a conversation and its items.

Theory of operation: `POST /v1/conversations` (`items` up to 20, `metadata`) makes one;
`GET`/`POST`/`DELETE /v1/conversations/{id}` read it, replace its metadata, delete it with
its items; `/v1/conversations/{id}/items` lists (newest first unless `order=asc`) and adds
items (up to 20 at a time), `/items/{item_id}` reads or deletes one. A response created
with `conversation` reads every item as its input's history and adds its own input and
output as new items (hub/api/responses.py). Ownership as every stored object (objects.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.bounds import echo
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, read_body, send_json
from appliance.http.errors import ApiError
from appliance.hub.api.objects import Caller, find, listing, maker, page_ask, store_of
from appliance.hub.store import ids
from appliance.hub.store import items as itemsmod
from appliance.hub.store.db import Obj

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

# OpenAI's metadata bound: 16 pairs.
METADATA_PAIRS = 16


def conversation(o: Obj) -> dict[str, Any]:
    return {"id": o.id, "object": "conversation", "created_at": o.created_at,
            "metadata": o.data.get("metadata") or {}}


async def _json(hub: Hub, receive: Receive) -> dict[str, Any]:
    try:
        body = await read_body(receive, hub.cfg.hub.max_body_bytes)
    except BodyTooLarge:
        raise ApiError(413, "body_too_large", "body over Hub__MaxBodyBytes") from None
    if not body.strip():
        return {}
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        raise ApiError(400, "invalid_json", "body is not valid JSON") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "invalid_request", "the body must be a JSON object")
    return obj


def _metadata(obj: dict[str, Any]) -> dict[str, str]:
    m = obj.get("metadata") or {}
    if not isinstance(m, dict) or len(m) > METADATA_PAIRS or not all(
            isinstance(v, str) for v in m.values()):
        raise ApiError(400, "invalid_request", f"metadata: up to {METADATA_PAIRS} string pairs",
                       param="metadata")
    return m


def _new_items(obj: dict[str, Any]) -> list[dict[str, Any]]:
    raw = obj.get("items") or []
    if not isinstance(raw, list) or len(raw) > itemsmod.MAX_ADD:
        raise ApiError(400, "invalid_request", f"items: an array of up to {itemsmod.MAX_ADD}",
                       param="items")
    return itemsmod.normalize(raw, "items")


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send, c: Caller,
                 rest: list[str]) -> None:
    store = store_of(hub)
    method = scope["method"]
    if not rest:
        if method != "POST":
            raise ApiError(405, "method_not_allowed", "/v1/conversations takes POST")
        obj = await _json(hub, receive)
        owner = maker(c)
        meta, new = _metadata(obj), _new_items(obj)
        await store.check_quota(owner)
        now = int(time.time())
        o = Obj(ids.new("conv_", hub.cfg.hub_name()), "conversation", owner, now, None, 0, "",
                {"metadata": meta})
        await store.put(o, [(i["id"], i) for i in new])
        await send_json(send, 200, conversation(o))
        return
    o = await find(hub, store, c, "conversation", "conv_", rest[0])
    if len(rest) == 1:
        if method == "GET":
            await send_json(send, 200, conversation(o))
        elif method == "POST":
            o.data["metadata"] = _metadata(await _json(hub, receive))
            await store.run(store.db.save, o)
            await send_json(send, 200, conversation(o))
        elif method == "DELETE":
            await store.remove(o)
            await send_json(send, 200, {"id": o.id, "object": "conversation.deleted",
                                        "deleted": True})
        else:
            raise ApiError(405, "method_not_allowed", "takes GET, POST or DELETE")
        return
    if rest[1] != "items" or len(rest) > 3:
        raise ApiError(404, "not_found", f"no route {method} /v1/conversations/"
                       f"{echo('/'.join(rest))}")
    if len(rest) == 2 and method == "GET":
        ask = page_ask(scope)
        data, more = await store.run(store.db.items, o.id, ask.after, ask.limit,
                                     ask.newest_first)
        await send_json(send, 200, listing(data, more))
    elif len(rest) == 2 and method == "POST":
        new = _new_items(await _json(hub, receive))
        store.room(len(msgspec.json.encode(new)))
        await store.run(store.db.add_items, o.id, [(i["id"], i) for i in new])
        await send_json(send, 200, listing(new, False))
    elif len(rest) == 3 and method == "GET":
        item = await store.run(store.db.item, o.id, rest[2])
        if item is None:
            raise ApiError(404, "not_found", f"No such item: {echo(rest[2])!r}")
        await send_json(send, 200, item)
    elif len(rest) == 3 and method == "DELETE":
        if not await store.run(store.db.delete_item, o.id, rest[2]):
            raise ApiError(404, "not_found", f"No such item: {echo(rest[2])!r}")
        await send_json(send, 200, conversation(o))
    else:
        raise ApiError(405, "method_not_allowed", "no such method on conversation items")
