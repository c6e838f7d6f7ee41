"""The node's HTTP face: the node API under /node/v1/ and the engine's client paths.

Theory of operation: a plain ASGI callable dispatching on (method, path) by hand. It owns
no state of its own -- the `NodeStateKeeper` decides and counts, the `Engine` loads and
names upstreams -- and makes no decision beyond which handler runs. Every path but
`/health` needs `Authorization: Bearer <Auth__NodeToken>` (constant-time compared; an
empty token accepts all, with one warning at start): the proxied /v1 and /api paths too,
or anyone on the network could walk past the hub's keys and priorities.

- `GET /node/v1/watch` streams NDJSON: the full state first, a new state on every change
  (woken by the keeper, never polled), a heartbeat whenever `Node__HeartbeatSeconds`
  pass without a line. It ends when the client goes away or the node drains.
- `POST /node/v1/models/{model}/load|unload`: the model is percent-encoded (it holds ':'
  and '/'), so it is cut out of the raw path. Loads run inside
  `Engine__StartTimeoutSeconds`; the outcome is published as the model's state.
- The engine's client paths (/v1/..., /api/...) go to the proxy (proxy.py); model
  pulls and deletes to modelops.py.
"""

from __future__ import annotations

import hmac
import logging
import time
from urllib.parse import unquote

import httpx
import msgspec
import trio
from prometheus_client import CONTENT_TYPE_LATEST

from appliance.bounds import echo, echo_path
from appliance.config import Config
from appliance.http.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    bearer,
    read_body,
    send_json,
    send_text,
)
from appliance.http.errors import ApiError, api_of
from appliance.http.respond import send_api_error
from appliance.http.stream import cancel_on_disconnect
from appliance.node import modelops
from appliance.node.changes import ChangeWaiter
from appliance.node.engines.base import Engine, EngineError
from appliance.node.fence import Fence, Orders, parse_lease
from appliance.node.metrics import NodeMetrics
from appliance.node.proxy import EngineProxy
from appliance.node.routed import PUSH_SECONDS
from appliance.node.state import NodeStateKeeper
from appliance.observe.metricsapp import render
from appliance.observe.trace import Tracing
from appliance.wire import (
    EPOCH_HEADER,
    HEARTBEAT_HEADER,
    HUB_HEADER,
    LEASE_HEADER,
    Heartbeat,
    LoadRequest,
    StateEvent,
    encode_event,
    load_request_decoder,
)

log = logging.getLogger(__name__)

# A load/unload body is two short strings; 64 KiB is generous.
CONTROL_BODY_LIMIT = 64 * 1024
# Bound on unloading an engine whose load timed out (llamacpp stops it within ~8 s).
UNLOAD_AFTER_TIMEOUT_SECONDS = 5.0
NDJSON = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")]


class NodeApp:
    """`NodeApp(cfg, keeper, engine, metrics)` is the ASGI app; `await app.aclose()` at the end."""

    def __init__(self, cfg: Config, keeper: NodeStateKeeper, engine: Engine,
                 metrics: NodeMetrics | None = None, tracing: Tracing | None = None) -> None:
        self.cfg = cfg
        self.keeper = keeper
        self.changes = ChangeWaiter(keeper)
        self.engine = engine
        self.proxy = EngineProxy(cfg, keeper, engine, metrics, tracing)
        self.metrics = metrics
        # Auth__Nodes__N__Token for this node's name, else the shared Auth__NodeToken.
        self.token = cfg.auth.node_token_for(cfg.node_name()).encode()
        # The highest live leader epoch a load/unload carried (HA fencing: node/fence.py).
        self.fence = Fence()
        self.orders = Orders()  # which hubs gave orders lately (two: they fight over it)
        if not self.token:
            log.warning(
                "Auth__NodeToken is empty: the node API and the proxy accept anyone who can reach "
                "them")

    # --- dispatch ----------------------------------------------------------------------

    async def aclose(self) -> None:
        await self.proxy.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            await send_json(send, 200, {"status": "ok", "name": self.keeper.name})
            return
        # Every refusal is raised as an ApiError and answered here, in the path's shape (the
        # node API's, /node/v1/, is Ollama's, as `api_of` maps it), before any answer began.
        api = api_of(path)
        try:
            if not self._authorized(scope):
                raise ApiError(401, "invalid_api_key",
                               "missing or wrong node token (Auth__NodeToken)")
            if path.startswith("/node/v1/"):
                await self._node_api(scope, receive, send, path[len("/node/v1/"):], method)
            elif path.startswith(("/v1/", "/api/")):
                await self.proxy.handle(scope, receive, send, path, method, api)
            elif path == "/metrics" and self.metrics is not None:
                await send_text(send, 200, render(self.metrics.registry, [self.metrics.refresh]),
                                CONTENT_TYPE_LATEST.encode())
            else:
                raise ApiError(404, "not_found", f"no route {method} {echo_path(path)}")
        except ApiError as e:
            await send_api_error(send, api, e)

    def _authorized(self, scope: Scope) -> bool:
        if not self.token:
            return True
        got = (bearer(scope) or "").encode()
        return hmac.compare_digest(got, self.token)

    # --- /node/v1/ -----------------------------------------------------------------------

    async def _node_api(self, scope: Scope, receive: Receive, send: Send, rest: str,
                        method: str) -> None:
        k = self.keeper
        simple = {"watch": "GET", "state": "GET", "pause": "POST", "resume": "POST",
                  "leave": "POST", "join": "POST", "epoch": "POST"}
        if rest in simple:
            if method != simple[rest]:
                raise ApiError(405, "method_not_allowed", f"{rest} takes {simple[rest]}")
            elif rest == "watch":
                await self._watch(receive, send)
            elif rest == "state":
                await send_json(send, 200, k.snapshot())
            elif rest == "epoch":  # the leader re-asserting its epoch each tick
                stale = self._fence(scope)
                if stale:
                    await self._stale(send, "epoch", "", stale)
                else:
                    await send_json(send, 200, {"epoch": self.fence.epoch})
            else:
                {"pause": lambda: k.set_paused(True), "resume": lambda: k.set_paused(False),
                 "leave": lambda: k.set_left(True), "join": lambda: k.set_left(False)}[rest]()
                log.info("node %s: %s by the owner", k.name, rest)
                await send_json(send, 200, k.snapshot())
            return
        if rest in ("pull", "delete"):
            if method != "POST":
                raise ApiError(405, "method_not_allowed", f"{rest} takes POST")
            else:
                await modelops.handle(self.engine, self.proxy.pool,
                                     self.cfg.node.upstream_read_seconds, receive, send, rest)
            return
        model, action = self._model_path(scope)
        if model is None or action not in ("load", "unload"):
            raise ApiError(404, "not_found", f"no route {method} /node/v1/{rest}")
        if method != "POST":
            raise ApiError(405, "method_not_allowed", f"{action} takes POST")
        try:
            body = await read_body(receive, CONTROL_BODY_LIMIT)
            req = load_request_decoder.decode(body) if body.strip() else LoadRequest()
        except BodyTooLarge:
            raise ApiError(413, "body_too_large", f"body over {CONTROL_BODY_LIMIT} bytes") from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise ApiError(400, "invalid_json",
                           f"body is not a LoadRequest: {e or 'nested too deeply'}") from None
        stale = self._fence(scope)
        if stale:
            await self._stale(send, action, model, stale)
            return
        self._ordered_by(scope)
        if action == "load":
            await self._load(send, model, req)
        else:
            await self._unload(send, model)

    def _fence(self, scope: Scope) -> str:
        """Why a load/unload is refused as coming from a deposed leader, or "" to go ahead.
        No epoch header (a single hub without etcd): always go ahead."""
        headers = dict(scope["headers"])
        raw = headers.get(EPOCH_HEADER.encode())
        if raw is None:
            return ""
        if len(raw) > 20 or not raw.isdigit():
            return f"{EPOCH_HEADER} {echo(raw.decode('latin-1'), 40)!r} is not an epoch"
        lease = parse_lease(headers.get(LEASE_HEADER.encode()), self.cfg.cluster.lease_seconds)
        before, forgotten = self.fence.epoch, self.fence.forgotten
        why = self.fence.check(int(raw), lease, trio.current_time())
        if self.fence.forgotten != forgotten:
            log.warning("epoch %d was not asserted for a lease: taking epoch %d", before,
                        self.fence.epoch)
        return why

    def _ordered_by(self, scope: Scope) -> None:
        """Note which hub gave this order; two hubs giving orders without an HA epoch fight
        over this node: said in the log and in the node's state (`hubs`)."""
        headers = dict(scope["headers"])
        hub = headers.get(HUB_HEADER.encode())
        if hub is None or EPOCH_HEADER.encode() in headers:
            return
        hubs = self.orders.seen(hub.decode("latin-1"), trio.current_time())
        if hubs is None:
            return
        if len(hubs) > 1:
            log.warning("hubs %s all give this node orders without Cluster__Etcd: they undo "
                        "each other's loads; give them one etcd, or this node one hub",
                        ", ".join(echo(h, 64) for h in hubs))
        self.keeper.set_hubs(hubs)

    async def _stale(self, send: Send, action: str, model: str, why: str) -> None:
        log.warning("refused %s%s: %s", action, f" of {echo(model, 80)}" if model else "", why)
        await send_json(send, 409, {"error": why, "code": "stale_leader",
                                    "epoch": self.fence.epoch})

    @staticmethod
    def _model_path(scope: Scope) -> tuple[str | None, str]:
        """`/node/v1/models/{percent-encoded model}/{action}` from the raw path."""
        raw = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        prefix = "/node/v1/models/"
        if not raw.startswith(prefix):
            return None, ""
        enc, _, action = raw[len(prefix):].rpartition("/")
        model = unquote(enc)
        return (model or None), action

    async def _load(self, send: Send, model: str, req: LoadRequest) -> None:
        k, timeout = self.keeper, self.cfg.engine.start_timeout_seconds
        k.load_started(model)
        log.info("loading %s (source %r, args %r)", model, req.source, req.args)
        try:
            with trio.move_on_after(timeout) as cs:
                await self.engine.load(model, req.source, req.args)
        except (EngineError, httpx.HTTPError, OSError) as e:
            error = str(e) or type(e).__name__
            k.load_failed(model, error)
            log.warning("load of %s failed: %s", model, error)
            raise ApiError(502, "load_failed", error) from e
        except BaseException:
            k.load_failed(model, "load interrupted (node shutting down)")
            raise
        if cs.cancelled_caught:
            error = f"health never came in {timeout:g} s"
            k.load_failed(model, error)
            log.warning("load of %s failed: %s", model, error)
            with trio.move_on_after(UNLOAD_AFTER_TIMEOUT_SECONDS, shield=True):
                try:
                    await self.engine.unload(model)
                except (EngineError, httpx.HTTPError, OSError) as e:
                    log.warning("unload of %s after its timeout failed: %s", model, e)
            raise ApiError(504, "load_timeout", error)
        k.load_done(model)
        log.info("%s is ready", model)
        await send_json(send, 200, {"model": model, "state": "ready"})

    async def _unload(self, send: Send, model: str) -> None:
        timeout = self.cfg.engine.start_timeout_seconds
        try:
            with trio.move_on_after(timeout) as cs:
                await self.engine.unload(model)
        except (EngineError, httpx.HTTPError, OSError) as e:
            raise ApiError(502, "unload_failed", str(e) or type(e).__name__) from e
        if cs.cancelled_caught:
            raise ApiError(504, "unload_timeout", f"unload took over {timeout:g} s")
        self.keeper.unloaded(model)
        log.info("%s unloaded", model)
        await send_json(send, 200, {"model": model, "state": "available"})

    async def _watch(self, receive: Receive, send: Send) -> None:
        every = f"{self.cfg.node.heartbeat_seconds:g}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*NDJSON, (HEARTBEAT_HEADER.encode(), every)]})
        self.keeper.watchers += 1
        try:
            async with cancel_on_disconnect(receive) as client:
                await self._watch_lines(send)
        finally:
            self.keeper.watchers -= 1
        if not client.gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch_lines(self, send: Send) -> None:
        k, every = self.keeper, self.cfg.node.heartbeat_seconds
        last = b""
        sent_at = trio.current_time()
        next_beat = sent_at + every
        while not k.draining:
            seen = k.version
            line = encode_event(StateEvent(k.snapshot()))
            if line != last:
                await send({"type": "http.response.body", "body": line, "more_body": True})
                last, sent_at = line, trio.current_time()
                next_beat = trio.current_time() + every
            with trio.move_on_at(next_beat):
                await self.changes.wait_changed(seen)
                if k.version == k.quiet_version:  # counts only (HA): at a bounded pace
                    await trio.sleep_until(sent_at + PUSH_SECONDS)
            if trio.current_time() >= next_beat:
                # A state that changed quietly (in-flight counts) goes out as the heartbeat.
                line = encode_event(StateEvent(k.snapshot()))
                if line == last:
                    line = encode_event(Heartbeat(ts=time.time()))
                else:
                    last = line
                await send({"type": "http.response.body", "body": line, "more_body": True})
                next_beat = trio.current_time() + every

    # --- the engine's client paths -------------------------------------------------------
