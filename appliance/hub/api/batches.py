"""OpenAI's Batch API and Anthropic's Message Batches on one machinery (hub/store/runner.py).

Theory of operation: `POST /v1/batches` takes an uploaded `batch` file of the caller's and
one of the endpoints lines may name; the batch is stored `validating` and its lines are
checked by the runner, off the request; one whose input file another hub holds is made on
that hub (hub/store/peers.py). `POST /v1/messages/batches` takes its requests
inline (bounded by Hub__MaxBodyBytes): their shape is checked here (a bad one is a 400
for the whole batch, as Anthropic answers), their params by the router when each runs.
Retrieve, list and cancel read the store; a running batch is read from the runner (its
counts are the freshest). Anthropic's results are JSONL read from the lines, in input
order, a chunk at a time; OpenAI's are the output and error files (files.py).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import msgspec

from appliance.bounds import echo
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, read_body, replay, send_json
from appliance.http.errors import ApiError
from appliance.hub.api import peerlists
from appliance.hub.api.objects import Caller, find, listing, maker, page_ask, store_of
from appliance.hub.store import ids, lines, peers
from appliance.hub.store.db import Obj
from appliance.hub.store.runner import RUNNING, WINDOW_SECONDS

if TYPE_CHECKING:
    from appliance.hub.hub import Hub
    from appliance.hub.store.store import Store

# OpenAI's bound on metadata: 16 pairs, keys of 64 characters, values of 512.
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512
RESULTS_CHUNK = 1000


def _fresh(hub: Hub, o: Obj) -> Obj:
    return hub.batches.live.get(o.id, o) if hub.batches is not None else o


def openai_batch(o: Obj) -> dict[str, Any]:
    d = o.data
    keys = ("endpoint", "errors", "input_file_id", "completion_window", "status",
            "output_file_id", "error_file_id", "created_at", "in_progress_at", "expires_at",
            "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
            "cancelled_at", "metadata")
    out: dict[str, Any] = {"id": o.id, "object": "batch"}
    out.update({k: d.get(k) for k in keys})
    counts = d.get("request_counts") or {}
    out["request_counts"] = {k: counts.get(k, 0) for k in ("total", "completed", "failed")}
    return out


def _rfc3339(t: int | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00",
                                                                                      "Z")


def anthropic_batch(o: Obj, states: dict[str, int]) -> dict[str, Any]:
    d = o.data
    status = {"cancelling": "canceling"}.get(o.state, "in_progress" if o.state in RUNNING
                                             else "ended")
    return {"id": o.id, "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": states.get("pending", 0),
                               "succeeded": states.get("completed", 0),
                               "errored": states.get("failed", 0),
                               "canceled": states.get("cancelled", 0),
                               "expired": states.get("expired", 0)},
            "ended_at": _rfc3339(d.get("ended_at")), "created_at": _rfc3339(o.created_at),
            "expires_at": _rfc3339(d.get("expires_at")), "archived_at": None,
            "cancel_initiated_at": _rfc3339(d.get("cancelling_at")),
            "results_url": f"/v1/messages/batches/{o.id}/results" if status == "ended"
            else None}


class _Create(msgspec.Struct):
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None


def _output_expiry(e: dict[str, Any] | None) -> int | None:
    """OpenAI's `output_expires_after` ({anchor: created_at, seconds: 3600..2592000}): the
    seconds the output and error files are kept after they are made; None: kept."""
    if e is None:
        return None
    seconds = e.get("seconds")
    if e.get("anchor") != "created_at" or not isinstance(seconds, int) \
            or not 3600 <= seconds <= 30 * 86400:
        raise ApiError(400, "invalid_request", "output_expires_after is anchor created_at and "
                       "seconds 3600..2592000", param="output_expires_after")
    return seconds


def _metadata(m: dict[str, str] | None) -> dict[str, str] | None:
    if m is not None and (len(m) > METADATA_PAIRS or any(
            len(k) > METADATA_KEY or len(v) > METADATA_VALUE for k, v in m.items())):
        raise ApiError(400, "invalid_request", f"metadata: at most {METADATA_PAIRS} pairs, keys "
                       f"of {METADATA_KEY} characters, values of {METADATA_VALUE}",
                       param="metadata")
    return m


async def _body(hub: Hub, receive: Receive) -> bytes:
    try:
        return await read_body(receive, hub.cfg.hub.max_body_bytes)
    except BodyTooLarge:
        raise ApiError(413, "body_too_large", "body over Hub__MaxBodyBytes") from None


def _decode(body: bytes, tp: Any) -> Any:
    try:
        return msgspec.json.decode(body, type=tp)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ApiError(400, "invalid_request", f"invalid request: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "body is not valid JSON: nested too deeply") from None


async def handle_openai(hub: Hub, scope: Scope, receive: Receive, send: Send, c: Caller,
                        rest: list[str]) -> None:
    store = store_of(hub)
    method = scope["method"]
    if not rest and method == "POST":
        body = await _body(hub, receive)
        req = _decode(body, _Create)
        holder = peers.elsewhere(hub, scope, req.input_file_id, "file-")
        if holder is not None:  # made where its input file is (hub/store/peers.py)
            await peers.forward(hub, scope, replay(body, receive), send,
                                req.input_file_id, holder)
            return
        owner = maker(c)
        if req.endpoint not in lines.ENDPOINTS:
            raise ApiError(400, "invalid_request", f"endpoint must be one of "
                           f"{', '.join(lines.ENDPOINTS)}", param="endpoint")
        if req.completion_window != "24h":
            raise ApiError(400, "invalid_request", "completion_window must be 24h",
                           param="completion_window")
        f = await find(hub, store, c, "file", "file-", req.input_file_id)
        if f.data.get("purpose") != "batch":
            raise ApiError(400, "invalid_request", "the input file's purpose is not batch",
                           param="input_file_id")
        await store.check_quota(owner)
        now = int(time.time())
        oid = ids.new("batch_", hub.cfg.hub_name())
        o = Obj(oid, "batch", owner, now, None, 0, "validating",
                {"endpoint": req.endpoint, "errors": None, "input_file_id": f.id,
                 "completion_window": "24h", "status": "validating", "created_at": now,
                 "expires_at": now + WINDOW_SECONDS, "metadata": _metadata(req.metadata),
                 "request_counts": {"total": 0, "completed": 0, "failed": 0},
                 "output_expires_seconds": _output_expiry(req.output_expires_after)})
        await store.put(o)
        _start(hub, o)
        await send_json(send, 200, openai_batch(o))
    elif not rest and method == "GET":
        ask = page_ask(scope)
        at = await peerlists.cursor_at(hub, scope, ask, store, "batch", "batch_", c.owner)
        objs, more = await store.run(store.db.page, "batch", c.owner, ask.after, ask.limit,
                                     ask.newest_first, "", (), at)
        data, more = await peerlists.merged(hub, scope, ask, at,
                                            [openai_batch(_fresh(hub, o)) for o in objs], more)
        await send_json(send, 200, listing(data, more))
    elif len(rest) == 1 and method == "GET":
        o = await find(hub, store, c, "batch", "batch_", rest[0])
        await send_json(send, 200, openai_batch(_fresh(hub, o)))
    elif len(rest) == 2 and rest[1] == "cancel" and method == "POST":
        o = await _cancel(hub, store, await find(hub, store, c, "batch", "batch_", rest[0]))
        await send_json(send, 200, openai_batch(o))
    else:
        raise ApiError(404, "not_found", f"no route {method} /v1/batches/{echo('/'.join(rest))}")


def _start(hub: Hub, o: Obj) -> None:
    if hub.batches is None:
        raise ApiError(501, "store_disabled", "this hub runs no batches")
    hub.batches.start(o)


async def _cancel(hub: Hub, store: Store, o: Obj) -> Obj:
    o = _fresh(hub, o)
    if o.state not in RUNNING:
        raise ApiError(400, "invalid_request", f"batch {o.id} is {o.state}: it cannot be "
                       "cancelled")
    if hub.batches is not None and o.id in hub.batches.live:
        return hub.batches.cancel(o)
    return o


class _MsgRequest(msgspec.Struct):
    custom_id: str
    params: dict[str, Any]


class _MsgCreate(msgspec.Struct):
    requests: list[_MsgRequest]


async def handle_anthropic(hub: Hub, scope: Scope, receive: Receive, send: Send, c: Caller,
                           rest: list[str]) -> None:
    store = store_of(hub)
    method = scope["method"]
    if not rest and method == "POST":
        req = _decode(await _body(hub, receive), _MsgCreate)
        owner = maker(c)
        o = await _create_msgbatch(hub, store, owner, req)
        await send_json(send, 200, anthropic_batch(o, {"pending": len(req.requests)}))
    elif not rest and method == "GET":
        ask = page_ask(scope)
        objs, more = await store.run(store.db.page, "msgbatch", c.owner, ask.after, ask.limit,
                                     ask.newest_first)
        data = [anthropic_batch(_fresh(hub, o), await store.run(store.db.line_states, o.id))
                for o in objs]
        await send_json(send, 200, {"data": data, "has_more": more,
                                    "first_id": data[0]["id"] if data else None,
                                    "last_id": data[-1]["id"] if data else None})
    else:
        o = _fresh(hub, await find(hub, store, c, "msgbatch", "msgbatch_", rest[0]))
        if len(rest) == 1 and method == "GET":
            await send_json(send, 200, anthropic_batch(o, await store.run(store.db.line_states,
                                                                          o.id)))
        elif len(rest) == 1 and method == "DELETE":
            if o.state in RUNNING:
                raise ApiError(400, "invalid_request", "a batch in progress cannot be deleted; "
                               "cancel it first")
            await store.remove(o)
            await send_json(send, 200, {"id": o.id, "type": "message_batch_deleted"})
        elif len(rest) == 2 and rest[1] == "cancel" and method == "POST":
            o = await _cancel(hub, store, o)
            await send_json(send, 200, anthropic_batch(o, await store.run(store.db.line_states,
                                                                          o.id)))
        elif len(rest) == 2 and rest[1] == "results" and method == "GET":
            if o.state in RUNNING:
                raise ApiError(400, "invalid_request", f"batch {o.id} is still in progress: "
                               "its results come once it has ended")
            await _send_results(store, o, send)
        else:
            raise ApiError(404, "not_found",
                           f"no route {method} /v1/messages/batches/{echo('/'.join(rest))}")


async def _create_msgbatch(hub: Hub, store: Store, owner: str, req: _MsgCreate) -> Obj:
    most = hub.cfg.batch.max_lines
    if not req.requests or len(req.requests) > most:
        raise ApiError(400, "invalid_request", f"requests: 1 to {most} (Batch__MaxLines)")
    seen: set[str] = set()
    rows: list[tuple[int, str, str, str | None, str | None]] = []
    for i, r in enumerate(req.requests):
        if not lines.ANTHROPIC_ID.fullmatch(r.custom_id):
            raise ApiError(400, "invalid_request", f"requests.{i}.custom_id: 1-64 of "
                           "A-Z a-z 0-9 _ -")
        if r.custom_id in seen:
            raise ApiError(400, "invalid_request", f"requests.{i}.custom_id "
                           f"{r.custom_id!r} is not unique")
        seen.add(r.custom_id)
        if not isinstance(r.params.get("model"), str):
            raise ApiError(400, "invalid_request", f"requests.{i}.params.model: a string")
        rows.append((i, r.custom_id, "pending", lines.request_body(r.params), None))
    await store.check_quota(owner)
    store.room(sum(len(r[3] or "") for r in rows))
    now = int(time.time())
    oid = ids.new("msgbatch_", hub.cfg.hub_name())
    o = Obj(oid, "msgbatch", owner, now, None, 0, "in_progress",
            {"endpoint": "/v1/messages", "status": "in_progress", "created_at": now,
             "in_progress_at": now, "expires_at": now + WINDOW_SECONDS,
             "request_counts": {"total": len(rows), "completed": 0, "failed": 0}})
    await store.run(store.db.add_lines, o, rows)
    store.charge(sum(len(r[3] or "") for r in rows))
    _start(hub, o)
    return o


async def _send_results(store: Store, o: Obj, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-jsonl")]})
    after = -1
    while True:
        rows = await store.run(store.db.results, o.id, after, RESULTS_CHUNK)
        if not rows:
            break
        out = []
        for idx, cid, state, raw in rows:
            after = idx
            res = msgspec.json.decode(raw) if raw else None
            out.append(lines.encode_line(lines.anthropic_line(cid, state, res)))
        await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
