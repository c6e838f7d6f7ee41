"""A hub worker process (`Hub__Workers=N>1`): accepts on the shared listener and relays.

Theory of operation (hub/workers.py has the main process's side): the worker serves the
inherited listening socket with the same listener defences as the hub. An inference POST:
read the body (bounded by Hub__MaxBodyBytes), hold a lease from the main process (lease.py:
`Ask` on one of the worker's kept connections to it, `_Leases`) and do what it says:
replay an `Answer`, or relay from the node in `Go` with the hub's own `LocalRelay`
(translation, stream errors, the node-lost and drain cuts as `Cut` messages);
a failure before the first byte goes back as `Failed`, the end as `Done`, acknowledged
before the last byte goes out (the audit line is written when the client has its answer).
The client hanging up cancels the lease, which gives the place back in the main process
(that connection is closed, not kept). SIGHUP re-reads the configuration (`reload`): the
listener's limits follow too, as in the main process.
Every other route is proxied to the main process's private HTTP socket: status, metrics,
admin and the UI are the main's answers, whole-hub. The worker exits when the main does
(PR_SET_PDEATHSIG, SIGTERM, or its lease socket gone).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio

from appliance import config as config_mod
from appliance.client.upstream import Pool
from appliance.config import Config
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, decode_content, read_body
from appliance.http.errors import ApiError, api_of
from appliance.http.respond import send_api_error
from appliance.http.stream import cancel_on_disconnect, drained, stalled
from appliance.hub import translate
from appliance.hub.api.app import INFERENCE
from appliance.hub.api.relay import LocalRelay, NotAnswered
from appliance.hub.api.request import Recorder, Request
from appliance.hub.api.router import decode_request
from appliance.hub.fleet.nodes import Flag
from appliance.hub.hub import auth_headers, client_ssl, hub_limits
from appliance.hub.workers.lease import (
    GONE,
    Ack,
    Answer,
    Ask,
    Conn,
    Cut,
    Done,
    Failed,
    Go,
    Left,
)
from appliance.server.limits import ListenerRefusal, LiveLimits
from appliance.server.serve import serve

log = logging.getLogger(__name__)

HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
       b"proxy-connection", b"trailer"}
ACK_SECONDS = 5.0


class _NoRecord(Recorder):
    """The main process writes the audit line and the metrics (from `Done`)."""

    def __init__(self) -> None:  # noqa: D107 -- nothing to hold
        pass

    def record(self, req: Request) -> None:
        pass


class _Cuts:
    """What the main's `Cut` messages said: the current node lost, the drain over."""

    def __init__(self) -> None:
        # Flags (hub/fleet/nodes.py: Flag): LocalRelay's cut subscribes to them, no watcher tasks.
        self.lost, self.drain, self.why = Flag(), Flag(), ""


class _Node:
    """What LocalRelay needs of a node, from `Go`; `lost` is set by a `Cut`."""

    def __init__(self, go: Go, cuts: _Cuts) -> None:
        self.name, self.url, self.auth_raw = go.node, go.url.rstrip("/"), go.auth
        if cuts.lost.is_set():
            cuts.lost = Flag()  # a new attempt, a new node
        self.lost = cuts.lost
        self._cuts = cuts

    @property
    def lost_reason(self) -> str:
        return self._cuts.why


class _Leases:
    """The worker's connections to the main's lease socket, kept between requests (at
    most KEEP idle): a lease that ended cleanly leaves its connection for the next."""

    KEEP = 64

    def __init__(self, path: str, max_bytes: Callable[[], int]) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.idle: list[Conn] = []

    async def ask(self, ask: Ask) -> Conn:
        """A connection with `ask` sent on it (and `ask.seq` set): a kept one, else new."""
        while self.idle:
            conn = self.idle.pop()
            conn.seq += 1
            ask.seq = conn.seq
            try:
                await conn.send(ask)
                return conn
            except GONE:
                await trio.aclose_forcefully(conn.stream)
        conn = Conn(await trio.open_unix_socket(self.path), self.max_bytes())
        conn.seq = ask.seq = 1
        try:
            await conn.send(ask)
        except BaseException:
            await trio.aclose_forcefully(conn.stream)
            raise
        return conn

    def done(self, conn: Conn, clean: bool) -> None:
        if clean and len(self.idle) < self.KEEP:
            conn.max_bytes = self.max_bytes()
            self.idle.append(conn)
        else:
            conn.stream.socket.close()  # type: ignore[attr-defined]  # no await: finally-safe


class Worker:
    def __init__(self, cfg: Config, where: str, env_file: str | None = None) -> None:
        self.cfg = cfg
        self.limits = LiveLimits(hub_limits(cfg))
        self.env_file = env_file
        self.leases = _Leases(os.path.join(where, "lease.sock"),
                              lambda: self.cfg.hub.max_body_bytes + 256 * 1024)
        self.upstream = Pool(headers=auth_headers(cfg), ssl_context=client_ssl(cfg))
        self.main = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=os.path.join(where, "http.sock")),
            timeout=httpx.Timeout(connect=5.0, read=cfg.hub.upstream_read_seconds, write=30.0,
                                  pool=10.0))

    def reload(self) -> bool:
        """SIGHUP (the main reloaded): the body bound, the node read timeout and the
        listener's limits follow for the next request; a configuration the main would
        refuse is refused here too (logged, the old one stays)."""
        try:
            new = config_mod.load(env_file=self.env_file)
        except config_mod.ConfigError as e:
            log.error("hub worker: reload refused, keeping the old configuration: %s", e)
            return False
        self.cfg = new
        self.limits.set(hub_limits(new))
        log.info("hub worker %d: configuration reloaded", os.getpid())
        return True

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = INFERENCE.get(scope["path"])
        # With a store, /v1/responses may read and write it (chains, conversations,
        # background): the main process answers it (hub/api/responses.py).
        stored = scope["path"] == "/v1/responses" and bool(self.cfg.store.path)
        if api is not None and scope["method"] == "POST" and not stored:
            await self.inference(scope, receive, send, api)
        else:
            await self.proxy(scope, receive, send)

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        try:
            body = await read_body(receive, self.cfg.hub.max_body_bytes)
        except BodyTooLarge:
            await send_api_error(send, api_of(path), ApiError(413, "body_too_large",
                                                              "body over Hub__MaxBodyBytes"))
            return
        qs = scope.get("query_string") or b""
        url = "http://hub" + scope.get("raw_path", path.encode()).decode("latin-1")
        if qs and b"?" not in url.encode():
            url += "?" + qs.decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP and k != b"content-length"]
        try:
            resp = await self.main.send(self.main.build_request(scope["method"], url,
                                                                headers=headers, content=body),
                                        stream=True)
        except httpx.HTTPError as e:
            await send_api_error(send, api_of(path), ApiError(503, "shutting_down",
                                                              f"the hub is not answering: {e}"))
            return
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw if k.lower() not in HOP]})
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()

    async def inference(self, scope: Scope, receive: Receive, send: Send, api: str) -> None:
        fail, body, refusal = "", b"", None
        headers = list(scope["headers"])
        try:
            body = await read_body(receive, self.cfg.hub.max_body_bytes)
            try:
                body = decode_content(headers, body, self.cfg.hub.max_body_bytes)
                headers = [(k, v) for k, v in headers if k != b"content-encoding"]
            except ApiError:
                pass  # sent as it came: the main's router refuses it in the API's shape
        except BodyTooLarge:
            fail = "too_large"
        except ListenerRefusal as e:
            fail, refusal = e.code, e
        except trio.BrokenResourceError:
            fail = "gone"
        ask = Ask(scope["path"], api, headers, body, fail)
        conn = await self.leases.ask(ask)
        clean = False
        try:
            if fail in ("", "too_large"):
                clean = await self._held(conn, ask.seq, scope, receive, send, api, body)
            else:
                with trio.move_on_after(ACK_SECONDS):  # the main records it, then closes
                    try:
                        await conn.recv()
                    except GONE:
                        pass
        finally:
            self.leases.done(conn, clean)
        if refusal is not None:
            raise refusal

    async def _held(self, conn: Conn, seq: int, scope: Scope, receive: Receive, send: Send,
                    api: str, body: bytes) -> bool:
        """The lease after `Ask`; True when it ended cleanly (the answer replayed, or the
        `Done` acknowledged, the client still there): the connection may serve another."""
        cuts, acked = _Cuts(), trio.Event()
        done_sent = False
        inbox_in, inbox = trio.open_memory_channel[Any](4)

        async def reader() -> None:
            try:
                async with inbox_in:
                    while True:
                        msg = await conn.recv()
                        if isinstance(msg, Cut):
                            if msg.seq != seq:
                                continue  # sent as an earlier lease on this connection ended
                            cuts.why = msg.lost_reason
                            (cuts.drain if msg.reason == "shutting_down" else cuts.lost).set()
                        elif isinstance(msg, Ack):
                            acked.set()
                        else:
                            await inbox_in.send(msg)
            except GONE:
                pass

        async def report() -> None:
            nonlocal done_sent
            if done_sent:
                return
            done_sent = True
            with trio.move_on_after(ACK_SECONDS, shield=True):
                try:
                    await conn.send(Done(req.node, req.status, req.ttfb, req.error,
                                         req.read_usage()))
                except GONE:
                    return
                await acked.wait()

        async def send_last_reported(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.body" and not msg.get("more_body"):
                await report()
            await send(msg)

        req = Request(scope, send_last_reported, api, _NoRecord())
        ended = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            try:
                async with cancel_on_disconnect(receive, lambda: req.done, scope) as client:
                    ended = await self._serve(conn, req, inbox, cuts, send, body, report)
                if client.gone and req.status:  # mid-answer: what was relayed is counted
                    if drained(scope):  # the listener's drain ended it (as the router says)
                        req.failed("shutting_down")
                    elif stalled(scope):
                        req.refused(499, "client_too_slow")
                    else:
                        req.refused(499, "client_disconnected")
                    await report()
                elif client.gone:  # before the relay: the main audits it as the client's
                    with trio.move_on_after(ACK_SECONDS, shield=True):
                        try:
                            await conn.send(Left())
                        except GONE:
                            pass
            finally:
                nursery.cancel_scope.cancel()
        return ended and not client.gone and (acked.is_set() or not done_sent)

    async def _serve(self, conn: Conn, req: Request, inbox: trio.MemoryReceiveChannel[Any],
                     cuts: _Cuts, send: Send, body: bytes,
                     report: Callable[[], Awaitable[None]]) -> bool:
        """Do what the main says; True once the lease ended as it should."""
        while True:
            try:
                msg = await inbox.receive()
            except trio.EndOfChannel:
                return False  # the main process went away: the connection just ends
            if isinstance(msg, Answer):
                await send({"type": "http.response.start", "status": msg.status,
                            "headers": msg.headers})
                await send({"type": "http.response.body", "body": msg.body})
                return True
            if not isinstance(msg, Go):
                return False
            req.resolved(msg.model, req.label, req.cls)
            given = decode_request(body).model
            plan = translate.prepare(req.path, req.api, body, given, msg.model).for_engine(
                msg.kind)
            try:
                relay = LocalRelay(self.upstream, self.cfg.hub.upstream_read_seconds,
                                   cuts.drain)
                await relay.relay(_Node(msg, cuts),  # type: ignore[arg-type]
                                  req, plan)
            except ApiError as e:
                await conn.send(Failed(e.message, drain=e.code == "shutting_down"))
                continue
            except NotAnswered as e:
                await conn.send(Failed(str(e)))
                continue
            await report()
            return True


async def run_worker(cfg: Config, fd: int, where: str, env_file: str | None = None) -> None:
    """Serve the inherited listener until SIGTERM; SIGHUP re-reads the configuration
    (`Worker.reload`)."""
    w = Worker(cfg, where, env_file)
    stop = trio.Event()
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.upstream.sweep_every)

            async def on_signal() -> None:
                async for sig in signals:
                    if sig == signal.SIGHUP:
                        w.reload()
                        continue
                    stop.set()  # stop accepting; the main's drain cuts what still runs
                    return

            nursery.start_soon(on_signal)
            # The listener's limits follow a reload (`Worker.reload`); its TLS files are the
            # main's at start (they change at the next start). The drain: the main's, plus
            # the time its `Cut` needs to end the streams here.
            await serve(w.app, cfg.hub.listen, "hub", shutdown_trigger=stop.wait,
                        limits=w.limits, drain_seconds=cfg.hub.drain_seconds + 2.0,
                        bind=f"fd://{fd}", announce=False, certfile=cfg.hub.tls_cert,
                        keyfile=cfg.hub.tls_key, ca_certs=cfg.hub.tls_ca)
            nursery.cancel_scope.cancel()


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        sys.exit(0)


def main(cfg: Config, spec: str, env_file: str | None = None) -> int:
    fd, _, where = spec.partition(":")
    _die_with_parent()
    try:
        trio.run(run_worker, cfg, int(fd), where, env_file)
    except KeyboardInterrupt:
        pass
    return 0
