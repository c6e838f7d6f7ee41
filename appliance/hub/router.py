"""Routing one inference request: authenticate, resolve, activate, admit, proxy, audit.

Theory of operation (DESIGN 3): the hub decodes only `model` (and `stream`) from the
body and forwards the bytes it received. Everything that refuses a request raises
ApiError and is answered in the API's own shape. The response is streamed byte for
byte: the hub waits for the node's first body chunk before it answers, so a node that
fails before the first byte is retried once on another node (the least loaded other);
after that a failure ends the stream with an error event (`node_lost`), as does the node
being declared lost or the drain running out (`shutting_down`; relay.py). Exactly one
audit line and one count per request, whatever ends it. A client that hangs up cancels everything
it was waiting on (activation, a queue, the upstream request) and frees its place at
once. The audit line is written before the last byte goes out.
"""

from __future__ import annotations

import fnmatch
import hmac
import logging
import time

import msgspec
import trio

from appliance.asgi import BodyTooLarge, read_body
from appliance.bounds import OTHER_LABEL, echo
from appliance.config import ClientConfig
from appliance.http.disconnect import cancel_on_disconnect, wait_disconnect
from appliance.http.errors import ApiError
from appliance.http.keys import request_key
from appliance.http.stream import Cut, relay_chunks, stream_error
from appliance.hub import translate
from appliance.hub.relay import cut_before_answer
from appliance.hub.requestid import request_id
from appliance.hub.translate.ollama import keep_alive_seconds, unload_answer
from appliance.listener import Refusal
from appliance.upstream import UpstreamError

log = logging.getLogger("appliance.hub.router")

ANONYMOUS = ClientConfig(name="anonymous", key="", priority="normal", models=[])
# Headers a client sends that the node should see too; the rest (keys) stay here.
FORWARD_HEADERS = (b"content-type", b"accept", b"x-request-id", b"user-agent")
# Retry-After for "no node can serve it now": about one heartbeat round of a fleet.
NO_CAPACITY_RETRY_AFTER = 5.0
# A request goes to at most two nodes: the first, and once more another before its first byte.
MAX_ATTEMPTS = 2


class _Req(msgspec.Struct):
    model: str
    stream: bool | None = None
    keep_alive: object = None  # Ollama's; checked by translate.ollama.keep_alive_seconds


_req_decoder = msgspec.json.Decoder(_Req)


def authenticate(hub, key: str | None) -> ClientConfig:
    """The client for `key`: a configured one, the anonymous one, or ApiError 401."""
    if key:
        found = None
        for c in hub.cfg.auth.clients:
            if hmac.compare_digest(c.key.encode(), key.encode()):
                found = c
        if found is not None:
            return found
    if hub.cfg.auth.require_keys:
        raise ApiError(401, "invalid_api_key", "missing API key" if not key else "unknown API key")
    return ANONYMOUS


def allowed(client: ClientConfig, model: str) -> bool:
    return not client.models or any(fnmatch.fnmatchcase(model, g) for g in client.models)


def decode_request(body: bytes) -> _Req:
    try:
        return _req_decoder.decode(body)
    except msgspec.ValidationError as e:
        raise ApiError(400, "invalid_request", f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    except RecursionError:
        # msgspec skips unknown fields recursively: 100k nested arrays exhaust the stack.
        raise ApiError(400, "invalid_json", "body is not valid JSON: nested too deeply") from None


class Outcome:
    """What the audit line and the metrics say about one request."""

    __slots__ = ("t0", "client", "cls", "model", "label", "path", "status", "node", "ttfb", "error",
                 "done", "tried",
                 "request_id")

    def __init__(self, path: str, request_id: str = "") -> None:
        self.request_id = request_id
        self.t0 = time.perf_counter()
        self.client = "anonymous"
        self.cls = "normal"
        self.model = ""
        # The model's metrics label: the name once the hub knows the model, else OTHER_LABEL
        # -- a client-chosen name never becomes a series (2,000 unknown names, one series).
        self.label = ""
        self.path = path
        self.status = 0
        self.node = ""
        self.ttfb: float | None = None
        self.error = ""
        self.done = False
        self.tried: list[str] = []


def record(hub, out: Outcome) -> None:
    """Audit line and metrics for a finished request; once."""
    if out.done:
        return
    out.done = True
    elapsed = time.perf_counter() - out.t0
    fields = {"client": out.client, "model": out.model, "path": out.path, "status": out.status,
              "node": out.node, "ms": round(elapsed * 1000, 2)}
    if out.request_id:
        fields["request_id"] = out.request_id
    if out.ttfb is not None:
        fields["ttfb_ms"] = round(out.ttfb * 1000, 2)
    if out.error:
        fields["error"] = out.error
    if hub.admission.enabled:
        fields["priority"] = out.cls
    hub.audit.request(**fields)
    m = hub.metrics
    m.requests.labels(out.client, out.label, str(out.status)).inc()
    if out.label and out.label != OTHER_LABEL:  # no histogram for names nobody serves
        m.latency.labels(out.label).observe(elapsed)
        if out.ttfb is not None:
            m.ttfb.labels(out.label).observe(out.ttfb)


async def send_error(hub, send, api: str, out: Outcome, e: ApiError) -> None:
    out.status = e.status
    out.error = e.code
    record(hub, out)
    headers = [(b"content-type", b"application/json"), *e.headers(), *_rid(out)]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": e.body(api)})


async def handle_inference(hub, scope, receive, send, api: str) -> None:
    """One POST to an inference route (`api` is "openai" or "ollama"): exactly one audit
    line and one count, whatever ends it (refused, malformed, client gone, node lost,
    drained, or a bug -- a 500 in the API's shape)."""
    out = Outcome(scope["path"], request_id(scope["headers"]))
    try:
        await _handle(hub, scope, receive, send, api, out)
    except ApiError as e:  # raised while the watcher was cancelling: still answered
        await send_error(hub, send, api, out, e)
    except Refusal as e:  # a body too slow, or too many bodies held: the listener answers
        out.status, out.error = e.status, e.code
        raise
    except Exception:
        log.exception("request for %r from %s failed inside the hub", out.model, out.client)
        if not out.done:
            try:
                await send_error(hub, send, api, out, ApiError(500, "internal_error",
                                                               "the hub failed on this request"))
            except Exception:  # the response had already started: the connection just ends
                pass
    finally:
        if not out.done:
            out.status = out.status or 499
            record(hub, out)


async def _handle(hub, scope, receive, send, api: str, out: Outcome) -> None:
    try:
        client = authenticate(hub, request_key(scope["headers"]))
        out.client = client.name
        try:
            body = await read_body(receive, hub.cfg.hub.max_body_bytes)
        except BodyTooLarge:
            limit = hub.cfg.hub.max_body_bytes
            raise ApiError(413, "body_too_large",
                           f"body over Hub__MaxBodyBytes ({limit} bytes)") from None
        req = decode_request(body)
        if not hub.grace.over() and not _ready(hub, req.model):
            # Just (re)started: the nodes are still reporting what they have (grace.py).
            if not await _wait_grace(hub, receive, req.model):
                out.status, out.error = 499, "client_disconnected"
                return
        model = translate.resolve(req.model, hub.control.known)
        out.model = echo(model)
        out.label = OTHER_LABEL
        out.cls = hub.admission.effective_class(client.priority, scope["headers"])
        if not allowed(client, model) or not hub.control.known(model):
            raise ApiError(404, "model_not_found", f"model {echo(req.model)!r} not found")
        out.label = model
        prep = translate.prepare(scope["path"], api, body, req.model, model)
        keep = keep_alive_seconds(req.keep_alive) if api == "ollama" else None
    except ApiError as e:
        await send_error(hub, send, api, out, e)
        return
    except trio.BrokenResourceError:
        out.status, out.error = 499, "client_disconnected"  # gone while sending its body
        return

    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            await wait_disconnect(receive)
            if out.done:
                # hypercorn says "disconnect" as the last byte goes out; cancelling now would
                # interrupt its recycling of the connection (then it never reads as idle).
                return
            out.error = "client_disconnected"
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            await _route(hub, scope, send, api, out, model, prep, keep)
        except ApiError as e:
            await send_error(hub, send, api, out, e)
        finally:
            nursery.cancel_scope.cancel()
            if not out.done:
                out.status = out.status or 499
                with trio.CancelScope(shield=True):
                    record(hub, out)


def _ready(hub, name: str) -> bool:
    return bool(hub.registry.ready_nodes(translate.resolve(name, hub.control.known)))


async def _wait_grace(hub, receive, name: str) -> bool:
    """Wait out the start-up grace for `name`; False when the client went away meanwhile."""
    async with cancel_on_disconnect(receive) as client:
        await hub.grace.wait_settled(lambda: _ready(hub, name))
    return not client.gone


def _rid(out: Outcome) -> list[tuple[bytes, bytes]]:
    return [(b"x-request-id", out.request_id.encode())] if out.request_id else []


async def _route(hub, scope, send, api: str, out: Outcome, model: str, prep: translate.Prepared,
                 keep: float | None) -> None:
    if prep.load_only and keep == 0:
        # Ollama's unload request: the control loop unloads the model once it is idle,
        # and does not load it again until asked; no node needs to see this one.
        hub.control.touch(model, keep)
        out.status = 200
        record(hub, out)
        body = unload_answer(model, scope["path"] == "/api/chat")
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            *_rid(out)]})
        await send({"type": "http.response.body", "body": body})
        return
    err = hub.control.unservable(model)
    if err is not None:
        raise err
    # In use: the request's own keep_alive shows at once (a client's `ps` right after its
    # answer sees it); 0 applies only once the work is done.
    hub.control.touch(model, None if keep == 0 else keep)
    if not hub.registry.ready_nodes(model):
        await hub.control.activate(model)
    ticket = await hub.admission.admit(model, out.cls, out.client)
    try:
        headers = [(k, v) for k, v in scope["headers"] if k in FORWARD_HEADERS
                   and k != b"x-request-id"]
        headers += _rid(out)
        await _proxy(hub, send, api, out, model, prep, headers)
    finally:
        hub.admission.release(ticket)
        hub.control.touch(model, keep)  # idle time counts from the end of the work


async def _proxy(hub, send, api, out: Outcome, model: str, prep: translate.Prepared,
                 headers) -> None:
    """Send to the best node; once more on the least loaded other one if it fails before
    the first byte. The operator's log line says what happened to whom."""
    registry = hub.registry
    tried: set[str] = set()
    last = "no node has the model ready"
    node = registry.pick(model)
    while node is not None:
        tried.add(node.name)
        out.tried.append(node.name)
        registry.start(node, model)
        hub.metrics.in_flight.labels(model).inc()
        try:
            await hub.admission.wait_slot(node, model, out.cls)
            plan = prep.for_engine(translate.engine_kind(node.state))
            ok, why = await _stream_from(hub, send, api, out, node, plan, headers)
            if ok:
                return
        finally:
            hub.metrics.in_flight.labels(model).dec()
            registry.finish(node, model)
        last = f"node {node.name} {why}"
        nxt = registry.pick(model, exclude=tried) if len(tried) < MAX_ATTEMPTS else None
        log.warning("%s: request for %s from %s %s", last, model, out.client,
                    f"retried on {nxt.name}" if nxt is not None else "has no other node to go to")
        node = nxt
    raise ApiError(503, "no_capacity", f"no node can serve {model!r} now ({last})",
                   retry_after=NO_CAPACITY_RETRY_AFTER)


async def _stream_from(hub, send, api, out: Outcome, node, plan: translate.Plan,
                       headers) -> tuple[bool, str]:
    """(True, "") once the response went out; (False, why) when it failed before the first
    byte -- including the node being declared lost while the request waited on it."""
    cut = Cut()
    async with trio.open_nursery() as watchers:
        watchers.start_soon(cut.watch, node.lost, "node_lost")
        watchers.start_soon(cut.watch, hub.drain_over, "shutting_down")
        try:
            return await _relay(hub, send, api, out, node, plan, headers, cut)
        finally:
            watchers.cancel_scope.cancel()


async def _relay(hub, send, api, out: Outcome, node, plan: translate.Plan, headers,
                 cut: Cut) -> tuple[bool, str]:
    resp = None
    headers = [*headers, *node.auth_raw]  # a per-node token replaces the shared one
    with cut.reading():
        try:
            resp = await hub.upstream.request("POST", node.url + plan.path, headers, plan.body,
                                              hub.cfg.hub.upstream_read_seconds)
        except UpstreamError as e:
            return False, str(e)
    if resp is None:
        return cut_before_answer(cut)
    raw = resp.chunks()
    conv = plan.converter(resp.status_code)
    chunks = raw if conv is None else translate.Relay(raw, conv)
    try:
        if resp.status_code == 503:
            # The node (paused, full) or its engine (still loading) refused: try another.
            why = b""
            with cut.reading():
                why = (await resp.read())[:200]
            return False, f"answered 503 ({why.decode(errors='replace')})"
        first = None
        with cut.reading():
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                first = b""
            except UpstreamError as e:
                return False, str(e)
        if first is None:
            return cut_before_answer(cut)
        out.node = node.name
        out.status = resp.status_code
        out.ttfb = time.perf_counter() - out.t0
        ctype = resp.headers.get("content-type",
                                 "application/json") if conv is None else conv.content_type.decode()
        start_headers = [(b"content-type", ctype.encode()), *_rid(out)]
        clen = resp.headers.get("content-length") if conv is None else (str(len(first))
                                                                        if chunks.ended else None)
        if clen is not None and clen.isdigit() and int(clen) == len(first):
            # A whole answer in the first read (every short, non-streamed one): one
            # body message with its length, no chunked framing, fewer writes.
            start_headers.append((b"content-length", clen.encode()))
            record(hub, out)
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": start_headers})
            await send({"type": "http.response.body", "body": first, "more_body": False})
            return True, ""
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": start_headers})
        tail = b""
        if first:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            tail = first[-2:]
        relayed = await relay_chunks(chunks, send, cut, (UpstreamError,), tail)
        failure, tail = relayed.failure, relayed.tail
        if not relayed.ended:
            code = cut.reason or "node_lost"
            if code == "shutting_down":
                msg = ("the hub is shutting down: stream cut at the end of the drain "
                       "(Hub__DrainSeconds)")
            elif cut.reason:
                msg = f"node {node.name} was declared lost mid-stream ({node.lost_reason})"
            else:
                msg = f"node {node.name} {failure}"
            out.error = code
            log.warning("%s: request for %s from %s ends with %s", msg, out.model, out.client, code)
            record(hub, out)
            if clen is None:  # a sized body cannot carry an error event; it just ends short
                await send({"type": "http.response.body", "body": stream_error(ctype, api, code,
                                                                               msg, tail),
                            "more_body": False})
            return True, ""
        record(hub, out)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True, ""
    finally:
        with trio.move_on_after(1, shield=True):
            await raw.aclose()
            await resp.aclose()
