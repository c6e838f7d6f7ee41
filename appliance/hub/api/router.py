"""Routing one inference request: authenticate, resolve, make servable, place, relay.

Theory of operation (DESIGN 3): the hub decodes only `model` (and `stream`, Ollama's
`keep_alive`) from the body and forwards the bytes it received. Everything that refuses a
request raises ApiError and is answered in the API's own shape. The request path, file by
file: this module makes the `Request` (request.py: who, what, where, what happened) and
decides; `Control.make_servable` has a replica ready (activation.py waits); the request's
place is one `async with Admission.place(...)` (admission.py: admitted, on one node at a
time, counted in flight, given back on any exit); `relay.relay_from` copies one node's
answer. A node that fails before the first byte is retried once on another node (the
least loaded other); after it a failure ends the stream with an error event (`node_lost`),
as does the node being declared lost or the drain running out (`shutting_down`).
Exactly one audit line and one count per request, whatever ends it (`Request.finish`),
written before the last byte goes out. A client that hangs up cancels everything it was
waiting on (activation, a queue, the upstream request) and frees its place at once.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from appliance.bounds import OTHER_LABEL, echo
from appliance.config import AuthConfig, ClientConfig
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, decode_json, read_body
from appliance.http.budget import hold_decoded
from appliance.http.disconnect import cancel_on_disconnect, drained, stalled
from appliance.http.encoding import decode_content
from appliance.http.errors import ApiError
from appliance.http.keys import request_key
from appliance.hub import translate
from appliance.hub.api.relay import NotAnswered, relay_from
from appliance.hub.api.request import Recorder, Request
from appliance.hub.decide import capable, fair
from appliance.hub.decide.admission import Demand
from appliance.hub.decide.limits import output_cap
from appliance.hub.observe.spans import RequestSpan
from appliance.hub.translate.ollama import keep_alive_seconds, unload_answer
from appliance.hub.translate.outcap import ROOM, with_cap
from appliance.server.limits import Refusal

if TYPE_CHECKING:
    from appliance.hub.decide.admission import Place
    from appliance.hub.fleet.nodes import NodeHandle
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

ANONYMOUS = ClientConfig(name="anonymous", key="", priority="normal", models=[])
# Retry-After for "no node can serve it now": about one heartbeat round of a fleet.
NO_CAPACITY_RETRY_AFTER = 5.0
# A request goes to at most two nodes: the first, and once more another before its first byte.
MAX_ATTEMPTS = 2


class _Req(msgspec.Struct):
    model: str
    stream: bool | None = None
    keep_alive: object = None  # Ollama's; checked by translate.ollama.keep_alive_seconds


_req_decoder = msgspec.json.Decoder(_Req)

# One attempt on one node: returns once answered; raises relay.NotAnswered when it failed
# before the first byte (another node may be tried), ApiError when refused. Today's process
# copies the answer itself (relay_from); the main process of a hub with workers hands the
# place to the worker holding the client (hub/workers/pool.py).
RelayFn = Callable[["NodeHandle", Request, translate.Plan], Awaitable[None]]
# What a request whose connection ended before its answer is audited as: (499,
# client_disconnected), unless its holder knows better (a hub worker that died: worker_lost).
Hangup = Callable[[], tuple[int, str]]


def _client_hangup() -> tuple[int, str]:
    return 499, "client_disconnected"


def authenticate(auth: AuthConfig, key: str | None) -> ClientConfig:
    """The client for `key`: a configured one, the anonymous one, or ApiError 401."""
    if key:
        found = None
        for c in auth.clients:
            if hmac.compare_digest(c.key.encode(), key.encode()):
                found = c
        if found is not None:
            return found
    if auth.require_keys:
        raise ApiError(401, "invalid_api_key", "missing API key" if not key else "unknown API key")
    return ANONYMOUS


def allowed(client: ClientConfig, model: str) -> bool:
    return not client.models or any(fnmatch.fnmatchcase(model, g) for g in client.models)


def decode_request(body: bytes) -> _Req:
    return decode_json(_req_decoder, body)


def decode_body(body: bytes) -> tuple[_Req, dict[str, Any]]:
    """The fields the router reads and the whole JSON object, from one decode (the object
    is what translate.prepare checks: a long prompt is parsed once, not twice). Any error
    is decode_request's own, word for word."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        try:
            return msgspec.convert(obj, _Req), obj
        except msgspec.ValidationError:
            pass
    return decode_request(body), translate.decode_object(body)  # raises, in its words


async def handle_inference(hub: Hub, scope: Scope, receive: Receive, send: Send,
                           api: str, relay: RelayFn | None = None,
                           hangup: Hangup = _client_hangup) -> None:
    """One POST to an inference route: exactly one audit line and one count, whatever ends
    it (refused, malformed, client gone, node lost, drained, or a bug -- a 500 in the
    API's shape)."""
    req = Request(scope, send, api, Recorder(hub.audit, hub.metrics, hub.admission.enabled))
    if hub.tracing is not None:  # OTEL_EXPORTER_OTLP_ENDPOINT (hub/observe/spans.py)
        req.trace = RequestSpan(hub.tracing, req)
    try:
        await _handle(hub, req, receive, relay, hangup)
    except ApiError as e:  # raised while the watcher was cancelling: still answered
        await req.send_error(e)
    except Refusal as e:  # a body too slow, or too many bodies held: the listener answers
        req.status, req.error = e.status, e.code
        raise
    except Exception:
        log.exception("request for %r from %s failed inside the hub", req.model, req.client)
        if not req.done:
            try:
                await req.send_error(ApiError(500, "internal_error",
                                              "the hub failed on this request"))
            except Exception:  # the response had already started: the connection just ends
                pass
    finally:
        if not req.done and not req.error and drained(scope):
            req.error = "shutting_down"  # cut by the listener at the drain's end
        req.finish()  # synchronous: nothing in it can be cancelled
        if req.trace is not None:
            req.trace.end(req)


async def _handle(hub: Hub, req: Request, receive: Receive, relay: RelayFn | None,
                  hangup: Hangup) -> None:
    try:
        client = authenticate(hub.cfg.auth, request_key(req.headers))
        req.client = client.name
        limit = hub.cfg.hub.max_body_bytes
        try:
            wire = await read_body(receive, limit)
            body = decode_content(req.headers, wire, limit)  # gzip inflated within the bound
        except BodyTooLarge:
            raise ApiError(413, "body_too_large",
                           f"body over Hub__MaxBodyBytes ({limit} bytes)") from None
        hold_decoded(req.scope, body, len(wire))  # its decoded size counts against the budget
        asked, obj = decode_body(body)
        if not hub.grace.over() and not _ready(hub, asked.model):
            # Just (re)started: the nodes are still reporting what they have (grace.py).
            if not await _wait_grace(hub, receive, asked.model, req.scope):
                req.status, req.error = hangup()
                return
        model = translate.resolve(asked.model, hub.control.known)
        req.model = echo(model)
        req.label = OTHER_LABEL
        req.cls = hub.admission.effective_class(client.priority, req.headers)
        if not allowed(client, model) or not hub.control.known(model):
            raise ApiError(404, "model_not_found", f"model {echo(asked.model)!r} not found")
        req.label = model
        prep = translate.prepare(req.path, req.api, body, asked.model, model, obj)
        refuse_incapable(hub, model, obj)
        keep = keep_alive_seconds(asked.keep_alive) if req.api == "ollama" else None
        # The key's limits (limits.py): reserved now, settled in Request.finish. A key with
        # a token limit sends no request without an output cap: one is written in.
        cap = output_cap(obj)
        fixed = None if cap is not None or prep.load_only else hub.tenants.uncapped(
            client.name, time.time(), len(body) + ROOM)
        if fixed is not None:
            if (capped := with_cap(req.path, obj, fixed)) is not None:
                (obj, body), cap = capped, fixed
                prep = translate.prepare(req.path, req.api, body, asked.model, model, obj)
        req.lease = hub.tenants.admit(client.name, time.time(), len(body), cap)
        cost, weight = hub.tenants.demand(client.name, len(body), cap)
        req.demand = Demand(cost, weight, partial(_used, req))
        if not prep.load_only and "embed" not in req.path:
            req.route = hub.admission.affinity.key(obj, req.headers)
            req.route.size = len(body)
    except ApiError as e:
        await req.send_error(e)
        return
    except trio.BrokenResourceError:
        req.status, req.error = 499, "client_disconnected"  # gone while sending its body
        return

    # hypercorn says "disconnect" as the last byte goes out; cancelling then would
    # interrupt its recycling of the connection (then it never reads as idle).
    async with cancel_on_disconnect(receive, lambda: req.done, req.scope) as gone:
        try:
            await _route(hub, req, model, prep, keep, relay)
        except ApiError as e:
            await req.send_error(e)
    if gone.gone:
        if stalled(req.scope):  # it stopped reading: its place is back, nothing was delivered
            req.status, req.error = 499, "client_too_slow"
        elif drained(req.scope):  # the listener's drain ended it
            req.error = "shutting_down"
        else:  # audited as the hang-up, whatever had started (its tokens are counted)
            req.status, req.error = hangup()


def _used(req: Request) -> int | None:
    """What the request really cost, in fair queueing's terms (None: the engine said nothing)."""
    t = req.tokens
    return None if t is None or t.estimated else fair.cost(t.input, t.output)


def refuse_incapable(hub: Hub, model: str, obj: dict[str, Any]) -> None:
    """Images, tools or thinking for a model whose engines say it cannot (capable.py): a
    400 in the API's shape (as Ollama answers), not an engine's 500 or a silent drop."""
    if not any(needs(obj) for _, needs, _ in capable.NEEDS):
        return
    caps = capable.model_capabilities(hub.control.core.spec(model),
                                      list(hub.registry.nodes.values()), model)
    what = capable.lacking(caps, obj) if caps is not None else None
    if caps is not None and what is not None:
        raise ApiError(400, "invalid_request",
                       f"model {echo(model)!r} does not support {what} (its engine lists "
                       f"{', '.join(sorted(caps)) or 'no capabilities'})")


def _ready(hub: Hub, name: str) -> bool:
    return bool(hub.registry.ready_nodes(translate.resolve(name, hub.control.known)))


async def _wait_grace(hub: Hub, receive: Receive, name: str, scope: Scope) -> bool:
    """Wait out the start-up grace for `name`; False when the client went away meanwhile."""
    async with cancel_on_disconnect(receive, scope=scope) as client:
        await hub.grace.wait_settled(lambda: _ready(hub, name))
    return not client.gone


async def _route(hub: Hub, req: Request, model: str, prep: translate.Prepared,
                 keep: float | None, relay: RelayFn | None) -> None:
    if prep.load_only and keep == 0:
        # Ollama's unload request: the control loop unloads the model once it is idle,
        # and does not load it again until asked; no node needs to see this one.
        hub.control.touch(model, keep)
        req.status = 200
        body = unload_answer(model, req.path == "/api/chat")
        await req.send_start(200, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode()),
                                   *req.id_headers()])
        await req.send_last(body)
        return
    req.load_at = time.perf_counter()
    await hub.control.make_servable(model, keep)
    req.load_s = time.perf_counter() - req.load_at  # the activation wait (audit `load_ms`)
    try:
        in_flight = hub.metrics.in_flight_of(model)
        # Preemptible only where this process relays: a worker's first byte is known
        # here only when its answer has ended (Priority__Preempt).
        victim = req if relay is None else None
        req.queue_at = time.perf_counter()
        async with hub.admission.place(model, req.cls, req.client, in_flight,
                                       req.demand, req.route, victim) as place:
            req.queue_s = time.perf_counter() - req.queue_at  # admission's (audit `queue_ms`)
            await _proxy(hub, req, place, model, prep, relay)
    finally:
        hub.control.touch(model, keep)  # idle time counts from the end of the work


async def _proxy(hub: Hub, req: Request, place: Place, model: str,
                 prep: translate.Prepared, relay: RelayFn | None) -> None:
    """Send to the best node (affinity's first choice where it has one); once more on
    another if it fails before the first byte. The operator's log line says what happened
    to whom. A request answered tells affinity where its prompt is cached now."""
    last = "no node has the model ready"
    node = place.node
    while node is not None:
        req.tried = place.tried
        t = time.perf_counter()
        await place.wait_slot()
        req.queue_s = (req.queue_s or 0.0) + time.perf_counter() - t
        if req.sent_at is None:  # node_wait_ms: from the first send to the first byte
            req.sent_at = time.perf_counter()
        node = place.node or node  # a home wait that ran out moves it (decide/home.py)
        req.tried = place.tried
        if req.trace is not None:
            req.trace.attempt(node.name)
        plan = prep.for_engine(translate.engine_kind(node.state),
                               translate.context_length(node.state, model))
        req.node = node.name  # the audit line names where it went, even if it fails there
        try:
            if relay is not None:
                await relay(node, req, plan)
            else:
                await relay_from(node, req, plan, hub.upstream,
                                 hub.cfg.hub.upstream_read_seconds, hub.drain_over)
            if req.route is not None and req.status == 200:
                first = req.t0 + req.ttfb if req.ttfb is not None else None
                hub.admission.served(place, req.route, first)
            return
        except NotAnswered as e:
            last = f"node {node.name} {e}"
        nxt = place.next(MAX_ATTEMPTS)
        log.warning("%s: request for %s from %s %s", last, model, req.client,
                    f"retried on {nxt.name}" if nxt is not None else "has no other node to go to")
        node = nxt
    raise ApiError(503, "no_capacity", f"no node can serve {model!r} now ({last})",
                   retry_after=NO_CAPACITY_RETRY_AFTER)
