"""Routing one inference request: authenticate, resolve, make servable, place, relay.

Owns the decision path of one inference POST (DESIGN 3), over `Routing` -- the parts it
uses, built once by hub/hub.py -- and a `Relaying` strategy: this process copies the
answer (`relay.LocalRelay`), or a hub worker holding the client does (workers/pool.py).
The hub decodes `model` (and `stream`, Ollama's `keep_alive`) and forwards the bytes it
received. Everything that refuses raises ApiError, answered in the API's own shape. The
model is resolved, known and ready once per request; `Control.make_servable` has a
replica ready; the place is one `async with Admission.place(...)` (admitted, on one node
at a time, affinity's choice, given back on any exit); a node that fails before the first
byte is retried once on another. Exactly one audit line and one count per request
(`Request.finish`). A client that hangs up cancels whatever it was waiting on. It must
not copy bytes (relay.py) nor decide placement or admission (decide/).
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from appliance.bounds import OTHER_LABEL, echo
from appliance.config import AuthConfig, ClientConfig, Config
from appliance.http.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    decode_content,
    decode_json,
    hold_decoded,
    read_body,
    request_key,
)
from appliance.http.errors import ApiError
from appliance.http.stream import cancel_on_disconnect, drained, stalled
from appliance.hub import translate
from appliance.hub.api.relay import NotAnswered
from appliance.hub.api.request import Recorder, Request
from appliance.hub.decide import capable
from appliance.hub.decide.admission import Prompt
from appliance.hub.decide.limits import output_cap
from appliance.hub.decide.priority import effective_class
from appliance.hub.observe.spans import RequestSpan
from appliance.hub.translate.ollama import keep_alive_seconds, unload_answer
from appliance.hub.translate.outcap import ROOM, with_cap
from appliance.hub.translate.prompt import needs
from appliance.server.limits import ListenerRefusal

if TYPE_CHECKING:
    from appliance.hub.decide.admission import Admission
    from appliance.hub.decide.control import Control
    from appliance.hub.decide.grace import StartupGrace
    from appliance.hub.decide.limits import Limiter
    from appliance.hub.fleet.nodes import NodeHandle
    from appliance.observe.trace import Tracing

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

class Relaying(Protocol):
    """Who copies the answer: this process (relay.LocalRelay) or the hub worker holding the
    client (workers/pool.LeaseRelay)."""

    # Whether essential work may preempt the request before its first byte: only where
    # this process relays (a worker's first byte is known here only once it ended).
    preemptible: bool

    async def relay(self, node: NodeHandle, req: Request, plan: translate.Plan) -> None:
        """One attempt on one node: returns once answered; raises relay.NotAnswered when it
        failed before the first byte (another node may be tried), ApiError when refused."""

    def hangup(self) -> tuple[int, str]:
        """What a request whose connection ended before its answer is audited as: (499,
        client_disconnected), unless its holder knows better (a dead worker: worker_lost)."""


@dataclass
class Routing:
    """What the request path uses, built once (hub/hub.py) and reconfigured on reload."""

    auth: AuthConfig
    max_body_bytes: int
    limiter: Limiter
    control: Control
    admission: Admission
    grace: StartupGrace
    recorder: Recorder
    local: Relaying  # this process copies the answer
    tracing: Tracing | None = None  # OpenTelemetry (hub/observe/spans.py), when on

    def configure(self, cfg: Config) -> None:
        self.auth, self.max_body_bytes = cfg.auth, cfg.hub.max_body_bytes


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


def manages(auth: AuthConfig, client: ClientConfig, key: str | None) -> bool:
    """May this request's keep_alive unload (0) or pin (-1, or longer than the model's idle
    time) a model for everyone? The admin key, a client with `ManageModels`, or anyone on
    a hub with no clients configured (one tenant's box: Open WebUI's unload button). Any
    other key's keep_alive sets only its own hold, within the model's configured idle
    time (hub/decide/holds.py): one tenant neither unloads another's model nor pins it
    (issue 30 item 7)."""
    if client.manage_models:
        return True
    if auth.admin_key and key and hmac.compare_digest(auth.admin_key.encode(), key.encode()):
        return True
    return not auth.clients


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


async def handle_inference(routing: Routing, scope: Scope, receive: Receive, send: Send,
                           api: str, way: Relaying | None = None) -> None:
    """One POST to an inference route: exactly one audit line and one count, whatever ends
    it (refused, malformed, client gone, node lost, drained, or a bug -- a 500 in the
    API's shape). `way`: who copies the answer (this process when None)."""
    req = Request(scope, send, api, routing.recorder)
    if routing.tracing is not None:  # OTEL_EXPORTER_OTLP_ENDPOINT (hub/observe/spans.py)
        req.traced(RequestSpan(routing.tracing, req))
    try:
        await _handle(routing, req, receive, way or routing.local)
    except ListenerRefusal as e:  # a body too slow, or too many bodies held: the listener answers
        req.refused(e.status, e.code)
        raise
    except ApiError as e:  # raised while the watcher was cancelling: still answered
        await req.send_error(e)
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
            req.failed("shutting_down")  # cut by the listener at the drain's end
        req.finish()  # synchronous: nothing in it can be cancelled
        if req.trace is not None:
            req.trace.end(req)


async def _handle(r: Routing, req: Request, receive: Receive, way: Relaying) -> None:
    try:
        key = request_key(req.headers)
        client = authenticate(r.auth, key)
        req.identified(client.name)
        limit = r.max_body_bytes
        try:
            wire = await read_body(receive, limit)
            body = decode_content(req.headers, wire, limit)  # gzip inflated within the bound
        except BodyTooLarge:
            raise ApiError(413, "body_too_large",
                           f"body over Hub__MaxBodyBytes ({limit} bytes)") from None
        hold_decoded(req.scope, body, len(wire))  # its decoded size counts against the budget
        asked, obj = decode_body(body)
        model, known = translate.resolve(asked.model, r.control.known)
        ready = r.control.has_ready(model)
        if not ready and not r.grace.over():
            # Just (re)started: the nodes are still reporting what they have (grace.py).
            if not await _wait_grace(r, receive, asked.model, req.scope):
                req.hung_up(*way.hangup())
                return
            # what the nodes said since
            model, known = translate.resolve(asked.model, r.control.known)
            ready = r.control.has_ready(model)
        served = known and allowed(client, model)
        # The model's metrics label is its name once the hub knows it, else OTHER_LABEL: a
        # client-chosen name never becomes a series.
        shown = echo(asked.model)
        req.resolved(shown if model == asked.model else echo(model),
                     model if served else OTHER_LABEL,
                     effective_class(r.admission.enabled, client.priority, req.headers),
                     shown)
        if not served:
            raise ApiError(404, "model_not_found", f"model {shown!r} not found")
        prep = translate.prepare(req.path, req.api, body, asked.model, model, obj)
        refuse_incapable(r.control, model, obj)
        keep = keep_alive_seconds(asked.keep_alive) if req.api == "ollama" else None
        # A key that may not manage models holds the model for itself (hold: its name).
        hold = None if manages(r.auth, client, key) else client.name
        # The key's limits (limits.py): reserved now, settled in Request.finish; its lease
        # carries fair queueing's demand. A key with a token limit sends no request without
        # an output cap: one is written in.
        cap = output_cap(obj)
        fixed = None if cap is not None or prep.load_only else r.limiter.uncapped(
            client.name, time.time(), len(body) + ROOM)
        if fixed is not None:
            if (capped := with_cap(req.path, obj, fixed)) is not None:
                (obj, body), cap = capped, fixed
                prep = translate.prepare(req.path, req.api, body, asked.model, model, obj)
        req.admitted(r.limiter.admit(client.name, time.time(), len(body), cap))
    except ListenerRefusal:
        raise  # the listener answers it (handle_inference records it)
    except ApiError as e:
        await req.send_error(e)
        return
    except trio.BrokenResourceError:
        req.hung_up(499, "client_disconnected")  # gone while sending its body
        return

    prompt = None if prep.load_only or "embed" in req.path else Prompt(obj, req.headers,
                                                                        len(body))
    # Our server says "disconnect" as the answer's last byte goes out; cancelling then
    # would cut a finished request (`req.done` keeps it).
    async with cancel_on_disconnect(receive, lambda: req.done, req.scope) as gone:
        try:
            await _route(r, req, model, prep, keep, ready, prompt, way, hold)
        except ApiError as e:
            await req.send_error(e)
    if gone.gone:
        if stalled(req.scope):  # it stopped reading: its place is back, nothing was delivered
            req.refused(499, "client_too_slow")
        elif drained(req.scope):  # the listener's drain ended it
            req.failed("shutting_down")
        else:  # audited as the hang-up, whatever had started (its tokens are counted)
            req.hung_up(*way.hangup())


def refuse_incapable(control: Control, model: str, obj: dict[str, Any]) -> None:
    """Images, tools or thinking for a model whose engines say it cannot (capable.py): a
    400 in the API's shape (as Ollama answers), not an engine's 500 or a silent drop."""
    needed = needs(obj)
    if not needed:
        return
    caps = control.capabilities(model)
    what = capable.lacking(caps, needed) if caps is not None else None
    if caps is not None and what is not None:
        raise ApiError(400, "invalid_request",
                       f"model {echo(model)!r} does not support {what} (its engine lists "
                       f"{', '.join(sorted(caps)) or 'no capabilities'})")


async def _wait_grace(r: Routing, receive: Receive, name: str, scope: Scope) -> bool:
    """Wait out the start-up grace for `name`; False when the client went away meanwhile."""
    control = r.control
    async with cancel_on_disconnect(receive, scope=scope) as client:
        await r.grace.wait_settled(
            lambda: control.has_ready(translate.resolve(name, control.known)[0]))
    return not client.gone


async def _route(r: Routing, req: Request, model: str, prep: translate.Plan,
                 keep: float | None, ready: bool,
                 prompt: Prompt | None, way: Relaying, hold: str | None = None) -> None:
    """Make the model servable, take a place, and send to the best node (affinity's first
    choice where it has one); once more on another if it fails before the first byte. The
    operator's log line says what happened to whom. A request answered tells its place (and
    so affinity) where it was served."""
    if prep.load_only and keep == 0:
        # Ollama's unload request: the control loop unloads the model once it is idle,
        # and does not load it again until asked; no node needs to see this one. A key
        # that may not unload for everyone (`hold`) ends its own hold; the others' stay.
        r.control.touch(model, keep, hold)
        req.answered("", 200, None)
        body = unload_answer(model, req.path == "/api/chat")
        await req.send_start(200, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode()),
                                   *req.id_headers])
        await req.send_last(body)
        return
    t = time.perf_counter()
    await r.control.make_servable(model, keep, ready, hold)
    req.activated(since=t)  # the activation wait (audit `load_ms`)
    assert req.lease is not None  # admitted above
    waiting: float | None = time.perf_counter()  # admission's, then the slot's (`queue_ms`)
    try:
        in_flight = r.recorder.metrics.in_flight_of(model)
        victim = req if way.preemptible else None
        if req.trace is not None:  # its place in the queue, for the span's admission event
            req.trace.ahead = r.admission.waiting(model)
        async with r.admission.place(model, req.cls, req.client, in_flight, req.lease,
                                     prompt, victim) as place:
            last = "no node has the model ready"
            node = place.node
            while node is not None:
                await place.wait_slot()
                node = place.node or node  # a home wait that ran out moves it (decide/home.py)
                assert waiting is not None
                req.sent_to(node.name, place.tried, place.route, queued_since=waiting)
                waiting = None
                if req.trace is not None:
                    req.trace.attempt(node.name)
                plan = prep.for_engine(translate.engine_kind(node.state), translate.context_length(
                    node.state, model) if prep.need else 0)  # a context matters only then
                try:
                    await way.relay(node, req, plan)
                    if req.status == 200:
                        place.served(req.t0 + req.ttfb if req.ttfb is not None else None,
                                     req.usage.cache if req.usage is not None else None)
                    return
                except NotAnswered as e:
                    last = f"node {node.name} {e}"
                nxt = place.next(MAX_ATTEMPTS)
                log.warning("%s: request for %s from %s %s", last, model, req.client,
                            f"retried on {nxt.name}" if nxt is not None
                            else "has no other node to go to")
                node = nxt
                waiting = time.perf_counter()  # the next node's slot wait
            raise ApiError(503, "no_capacity", f"no node can serve {model!r} now ({last})",
                           retry_after=NO_CAPACITY_RETRY_AFTER)
    finally:
        if waiting is not None:  # a wait cut short (its client left, it timed out)
            req.gave_up(since=waiting)
        r.control.touch(model, keep, hold)  # idle time counts from the end of the work
