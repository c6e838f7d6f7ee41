"""The node's proxy: the engine's client paths (/v1/..., /api/...), relayed.

Theory of operation: `EngineProxy.handle` answers the listings (GET /v1/models, /api/tags,
/api/ps, /api/version) from the node's state and relays every POST to the engine that
serves its model. It reads the body (bounded by `Node__MaxBodyBytes`), decodes only
`model`, takes a place (node/request.py's `NodeRequest.start`) and streams the same bytes
to the engine
-- fitted to the fields it takes where they differ (engines/params.py), as JSON whatever
content type the client gave -- and the engine's bytes back, chunk by chunk
(`appliance.http.stream.relay_body`). The copy is cancelled when the client hangs up
(`appliance.http.stream`), so a client that goes away frees its place at once; an
engine that breaks off mid-stream ends the stream with an error event in its own framing.
Every request is counted and its place given back once (`NodeRequest.finish`).
A model marked unhealthy (node/health.py) is answered 503 `replica_unhealthy` at once, and
a request waiting on it for its first byte is cut and answered the same (the hub retries).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from appliance import __version__
from appliance.bounds import CLEANUP_SECONDS, echo, echo_path
from appliance.client.upstream import Pool, UpstreamError
from appliance.config import Config
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, read_body, send_json
from appliance.http.errors import Api, ApiError
from appliance.http.respond import send_api_error
from appliance.http.stream import cancel_on_disconnect, relay_body, stream_error
from appliance.node.engines.base import Engine, redacted
from appliance.node.engines.params import fit
from appliance.node.health import Waiting
from appliance.node.metrics import NodeMetrics
from appliance.node.request import NodeRequest
from appliance.node.routed import note_route
from appliance.node.state import NodeStateKeeper, NoPlace
from appliance.node.whole import Gather, hold_for
from appliance.observe.trace import Tracing, operation, passthrough
from appliance.wire import UNHEALTHY

log = logging.getLogger(__name__)

# Request headers the engine needs; everything else (our bearer above all) stays here. The
# body's type is the node's own: a JSON object it decoded (llama-cpp-python's FastAPI
# answers a body without `application/json` with an error).
FORWARD_REQUEST = (b"accept", b"accept-encoding", b"x-request-id", b"user-agent")
JSON_BODY = (b"content-type", b"application/json")
# Response headers the client needs to read the bytes as the engine meant them.
FORWARD_RESPONSE = ("content-type", "content-length", "content-encoding", "retry-after")


class _ModelOnly(msgspec.Struct):
    model: str
    stream: object = None  # anything: only `true` (or Ollama's default) says streamed


# Ollama's generating routes stream unless told `"stream": false`; OpenAI's only when asked.
STREAM_BY_DEFAULT = ("/api/chat", "/api/generate")


_model_decoder = msgspec.json.Decoder(_ModelOnly)


# The node API (/node/v1/) answers errors as `{"error": ...}`, Ollama's shape.
NODE_API: Api = "ollama"


class EngineProxy:
    def __init__(self, cfg: Config, keeper: NodeStateKeeper, engine: Engine,
                 metrics: NodeMetrics | None, tracing: Tracing | None = None) -> None:
        self.cfg, self.keeper, self.engine, self.metrics = cfg, keeper, engine, metrics
        self.tracing = tracing  # OTEL_EXPORTER_OTLP_ENDPOINT (observe/trace.py), else None
        self.health = keeper.health  # each ready model's first bytes watched (node/health.py)
        # The proxy's own lean client to the engine (appliance/client/upstream.py): no proxies
        # from the environment, no caps (admission is the node's, Node__MaxConcurrency).
        self.pool = Pool()

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def handle(self, scope: Scope, receive: Receive, send: Send, path: str, method: str,
                     api: str) -> None:
        if method == "GET":
            listing = self._listing(path)
            if listing is None:
                raise ApiError(405, "method_not_allowed",
                               "GET serves /v1/models, /api/tags, /api/ps, /api/version; "
                               f"{echo_path(path)} takes POST")
            await send_json(send, 200, listing)
            return
        if method != "POST":
            raise ApiError(405, "method_not_allowed", f"{echo_path(path)} takes POST")
        await self._proxy(scope, receive, send, api)

    def _listing(self, path: str) -> Any:
        """GET /v1/models, /api/tags, /api/ps, /api/version: answered from the node's state."""
        models = self.keeper.snapshot().models
        if path == "/v1/models":
            return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0,
                                                "owned_by": self.keeper.name} for m in models]}
        if path in ("/api/tags", "/api/ps"):
            shown = models if path == "/api/tags" else [m for m in models if m.state == "ready"]
            return {"models": [{"name": m.name, "model": m.name, "size": m.size_mb * 1024 * 1024,
                                "details": {}} for m in shown]}
        if path == "/api/version":
            return {"version": __version__}
        return None

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, api: str) -> None:
        limit = self.cfg.node.max_body_bytes
        try:
            body = await read_body(receive, limit)
        except BodyTooLarge:
            raise ApiError(413, "body_too_large",
                           f"request body is over Node__MaxBodyBytes ({limit} bytes)") from None
        except trio.BrokenResourceError:
            return
        try:
            head = _model_decoder.decode(body)
            model = head.model
        except msgspec.ValidationError:
            raise ApiError(400, "invalid_request",
                           "body must be a JSON object with a string `model`") from None
        except (msgspec.DecodeError, RecursionError):  # RecursionError: nested too deeply
            raise ApiError(400, "invalid_json", "body is not JSON") from None
        req = NodeRequest(self.keeper, self.metrics, model)
        client = None
        try:
            upstream = self.engine.upstream(model)
            if upstream is None:
                if any(m.name == model for m in self.engine.models()):
                    req.status = "503"
                    raise ApiError(503, "no_capacity",
                                   f"model {model} is not loaded on node {self.keeper.name}",
                                   retry_after=1)
                req.unknown_model()
                req.status = "404"
                raise ApiError(404, "model_not_found",
                               f"model {echo(model)} not found on node {self.keeper.name}")
            # The body as this engine takes it (engines/params.py: max_completion_tokens,
            # json_schema); untouched where it names neither.
            body = fit(self.engine.dialect(model), scope["path"], body)
            sick = self.health.unhealthy(model) if self.health is not None else ""
            if sick:
                req.status = "503"
                raise ApiError(503, UNHEALTHY,
                               f"model {model} on node {self.keeper.name} is unhealthy: {sick}",
                               retry_after=1)
            try:
                req.start()
            except NoPlace:
                req.status = "503"
                raise
            if self.keeper.watchers > 1:  # several hubs: where this key went (node/routed.py)
                note_route(self.keeper, model, scope["headers"])
            if self.tracing is not None:  # a child of the hub's attempt span
                op = operation(scope["path"])
                req.span = self.tracing.start(f"{op} {model}", scope["headers"], attributes={
                    "gen_ai.operation.name": op, "gen_ai.request.model": model,
                    "appliance.node": self.keeper.name, "url.path": scope["path"]})
            streamed = head.stream is True or (head.stream is None
                                               and scope["path"] in STREAM_BY_DEFAULT)
            hold = hold_for(scope["headers"]) if streamed else None
            if hold is not None:  # the hub only assembles it: gathered (node/whole.py)
                send = Gather(send, hold)
            # After the last byte a disconnect is just the end (the status is set then).
            async with cancel_on_disconnect(receive, lambda: req.status is not None,
                                            scope) as client:
                await self._watched(scope, send, api, upstream, body, req, streamed)
        finally:
            req.finish("client_gone" if client is not None and client.gone else "cancelled")
            if req.span is not None and self.tracing is not None:
                status = req.status or ("client_gone" if client is not None and client.gone
                                        else "cancelled")
                req.span.set_attribute("appliance.status", status)
                if not status.isdigit() or int(status) >= 500:
                    self.tracing.error(req.span, status)
                req.span.end()

    async def _watched(self, scope: Scope, send: Send, api: str, upstream: str, body: bytes,
                       req: NodeRequest, streamed: bool) -> None:
        """`_forward`, watched for its first byte (node/health.py): cut and answered 503
        `replica_unhealthy` (the hub tries another node) if the replica is marked unhealthy
        before the engine answers."""
        health = self.health
        if health is None:
            await self._forward(scope, send, api, upstream, body, req, None)
            return
        cs = trio.CancelScope()
        health.ready(req.model, trio.current_time())  # its engine answers: a ready model
        w = health.request(req.model, streamed, trio.current_time(), cs.cancel)
        try:
            with cs:
                await self._forward(scope, send, api, upstream, body, req, w)
        finally:
            health.ended(w, trio.current_time())
        if not (cs.cancelled_caught and w.was_cut):
            return
        why = (f"model {req.model} on node {self.keeper.name} is unhealthy: "
               f"{health.unhealthy(req.model) or 'no first byte in time'}")
        if req.sent_type is None:  # inside the disconnect watch: answered here
            req.status = "503"
            await send_api_error(send, api, ApiError(503, UNHEALTHY, why, retry_after=1))
        else:  # its head went out, no byte after it: the stream's own error event
            req.status = "engine_error"
            event = stream_error(req.sent_type, api, UNHEALTHY, why, status=503)
            await send({"type": "http.response.body", "body": event, "more_body": False})

    def _first_byte(self, send: Send, w: Waiting) -> Send:
        """`send` that tells the health watch of each body chunk."""
        health = self.health
        assert health is not None

        async def sending(message: dict[str, Any]) -> None:
            if message.get("body"):  # each chunk: the replica generates
                health.answered(w, trio.current_time())
            await send(message)
        return sending

    async def _forward(self, scope: Scope, send: Send, api: str, upstream: str, body: bytes,
                       req: NodeRequest, w: Waiting | None) -> None:
        """Stream `body` to the engine and its answer back; the status for metrics is set
        on `req` just before the last byte goes out."""
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        url = upstream + raw + (("?" + scope["query_string"].decode("latin-1"))
                                if scope.get("query_string") else "")
        headers = [JSON_BODY, *((k, v) for k, v in scope["headers"] if k in FORWARD_REQUEST)]
        # The engine continues the trace: this node's span, else the hub's context as it came.
        if req.span is not None and self.tracing is not None:
            headers += self.tracing.inject(req.span)
        else:
            headers += passthrough(scope["headers"])
        started = False
        resp = None
        try:
            resp = await self.pool.request(scope["method"], url, headers, body,
                                           self.cfg.node.upstream_read_seconds)
            out = [(k.encode(), resp.headers[k].encode("latin-1")) for k in FORWARD_RESPONSE
                   if k in resp.headers]
            whole = resp.whole()
            if whole is not None:  # a short answer, whole with its head: one message
                if w is not None and self.health is not None:
                    self.health.answered(w, trio.current_time())
                await send({"type": "http.response.start", "status": resp.status_code,
                            "headers": out})
                req.status = str(resp.status_code)
                await send({"type": "http.response.body", "body": whole, "more_body": False})
                return
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            started = True
            req.sent_type = resp.headers.get("content-type", "")
            # an UpstreamError (the engine broke off, or its read deadline) goes through
            await relay_body(resp, send if w is None else self._first_byte(send, w), None, ())
            req.status = str(resp.status_code)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except UpstreamError as e:
            log.warning("%s %s: engine at %s %s", scope["method"], raw, upstream, e)
            why = redacted(f"the engine {e}", upstream)  # the client reads no address
            if not started:
                req.status = "502"
                await send_api_error(send, api, ApiError(502, "engine_error", why))
            else:
                req.status = "engine_error"
                assert resp is not None  # started: it answered
                if "content-length" not in resp.headers:  # a sized body cannot carry an error event
                    ctype = resp.headers.get("content-type", "")
                    event = stream_error(ctype, api, "engine_error", why, status=502)
                    await send({"type": "http.response.body", "body": event, "more_body": False})
        finally:
            if resp is not None and not resp.released:
                with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                    await resp.aclose()

