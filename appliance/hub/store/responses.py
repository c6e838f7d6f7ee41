"""Stored responses and conversations, as the store keeps them, and background responses.

Theory of operation: a stored response is an object of kind `response` (its whole
`response` JSON as the client got it, the `previous_response_id` it followed, expiring
after Store__ResponseDays) with its own input items under it; `history` walks a chain
back to its first response and gives every turn's input and output items in order (the
engine is stateless: this is the input it gets). A conversation is an object of kind
`conversation` whose items are the turns in order; `record` appends a response's input
and output to it. `Background` runs `background: true` responses off the request, as
background work through the router (the same `serve` as batches), at most
Batch__MaxConcurrent at once, each cancellable; after a restart the queued ones run again.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from appliance.config import Config
from appliance.http.errors import ApiError
from appliance.hub.store import items as itemsmod
from appliance.hub.store.beside import Beside
from appliance.hub.store.db import Obj
from appliance.hub.store.runner import Serve, run_line, snapshot
from appliance.hub.store.store import Store

log = logging.getLogger("appliance.hub.responses")

# A chain longer than this is refused rather than walked (a loop cannot happen: a
# response names only an earlier one).
MAX_CHAIN = 1000
DAY = 86400


async def history(store: Store, owner: str, prev: str) -> tuple[list[dict[str, Any]], str]:
    """Every item of the chain ending at `prev`, first turn first; and the chain's first id
    (its session key)."""
    turns: list[list[dict[str, Any]]] = []
    oid: str | None = prev
    root = prev
    while oid:
        o = await store.get("response", oid, owner)
        if o is None:
            raise ApiError(404, "not_found", f"Previous response with id '{oid}' not found.",
                           param="previous_response_id")
        if o.state not in ("completed", "incomplete"):
            raise ApiError(400, "invalid_request", f"response {oid} is {o.state}: only a finished "
                           "response can be continued", param="previous_response_id")
        own, _ = await store.run(store.db.items, oid, None, itemsmod.MAX_HISTORY, False)
        turns.append(own + itemsmod.output_items(o.data.get("response") or {}))
        root = oid
        oid = o.data.get("previous_response_id")
        if len(turns) > MAX_CHAIN:
            raise ApiError(400, "invalid_request", f"the chain is over {MAX_CHAIN} responses")
    return [it for turn in reversed(turns) for it in turn], root


async def record(store: Store, owner: str, rid: str, response: dict[str, Any], prev: str | None,
                 own: list[dict[str, Any]], conversation: str | None, keep: bool,
                 days: int) -> None:
    """A finished response: stored (`keep`), and its turn added to its conversation."""
    now = int(time.time())
    if keep:
        o = Obj(rid, "response", owner, now, now + days * DAY, 0,
                str(response.get("status") or "completed"),
                {"response": response, "previous_response_id": prev})
        data = msgspec.json.encode(o.data)  # once: its size here, its text in the store
        o.bytes = len(data)
        await store.put_behind(o, [(i["id"], i) for i in own], data)
    if conversation:
        turn = own + itemsmod.output_items(response)
        await store.run(store.db.add_items, conversation, [(i["id"], i) for i in turn])


class Background:
    """`background: true` responses: run one by one off their request, cancellable."""

    def __init__(self, cfg: Callable[[], Config], store: Store, serve: Serve,
                 beside: Beside | None = None) -> None:
        self.cfg, self.store, self.serve = cfg, store, serve
        self.beside = beside or Beside(None)  # shared with the batches (beside.py)
        # Background responses in flight at once: as many as batch lines (the rest queue).
        self.limiter = trio.CapacityLimiter(cfg().batch.max_concurrent)
        self.scopes: dict[str, trio.CancelScope] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for o in await self.store.run(self.store.db.in_state, "response",
                                          ("queued", "in_progress")):
                self.start(o)
            task_status.started()
            await trio.sleep_forever()

    def start(self, o: Obj) -> None:
        assert self._nursery is not None
        cs = trio.CancelScope()
        self.scopes[o.id] = cs
        self._nursery.start_soon(self._one, o, cs)

    def cancel(self, oid: str) -> bool:
        cs = self.scopes.get(oid)
        if cs is None:
            return False
        cs.cancel()
        return True

    async def _one(self, o: Obj, cs: trio.CancelScope) -> None:
        resp = dict(o.data["response"])
        status, body = 0, b""
        going = False
        try:
            with cs:
                await self.limiter.acquire_on_behalf_of(cs)
                bc = self.cfg().batch
                await self.beside.room(bc.max_concurrent, bc.beside_percent)
                self.beside.started()
                going = True
                o.state = resp["status"] = "in_progress"
                o.data["response"] = resp
                await self.store.run(self.store.db.save, snapshot(o))
                status, body, _ = await run_line(self.serve, self.cfg(), o.owner,
                                                 "/v1/responses", o.data["request"].encode(),
                                                 "", o.data.setdefault("request_id",
                                                                       secrets.token_hex(16)))
        finally:
            if going:
                self.beside.ended()
            if cs in self.limiter.statistics().borrowers:
                self.limiter.release_on_behalf_of(cs)
            self.scopes.pop(o.id, None)
            with trio.move_on_after(10, shield=True):
                await self._finish(o, resp, cs.cancelled_caught, status, body)

    async def _finish(self, o: Obj, resp: dict[str, Any], cancelled: bool, status: int,
                      body: bytes) -> None:
        answer: Any = None
        if not cancelled and status == 200:
            try:
                answer = msgspec.json.decode(body)
            except msgspec.DecodeError:
                answer = None
        if cancelled:
            resp["status"] = "cancelled"
        elif isinstance(answer, dict):
            resp = {**answer, "background": True}
        else:
            try:
                err = msgspec.json.decode(body).get("error") or {}
            except (msgspec.DecodeError, AttributeError):
                err = {}
            resp["status"] = "failed"
            resp["error"] = {"code": str(err.get("code") or "server_error"),
                             "message": str(err.get("message") or f"the hub answered {status}")}
        o.data.pop("request", None)
        o.state = resp["status"]
        o.data["response"] = resp
        await self.store.run(self.store.db.save, snapshot(o))
        conv = o.data.get("conversation")
        if resp["status"] in ("completed", "incomplete") and conv:
            own, _ = await self.store.run(self.store.db.items, o.id, None, itemsmod.MAX_HISTORY,
                                          False)
            turn = own + itemsmod.output_items(resp)
            await self.store.run(self.store.db.add_items, conv, [(i["id"], i) for i in turn])
