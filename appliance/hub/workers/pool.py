"""`Hub__Workers=N>1`: the main process's side -- the shared listener, the leases, the workers.

Theory of operation (docs/hub-workers-design.md): the main process is today's hub, whole
(control loop, registry, admission, admin API, status, metrics, audit), and serves every
route on the client listener itself. With N>1 it binds that listener once and starts N-1
workers (the same executable; `APPLIANCE_HUB_WORKER` in their environment) that inherit
the listening socket (pass_fds) and accept from the same queue. A worker relays: for an
inference request it holds a lease (lease.py) on the private Unix socket `lease.sock`; the
main process runs the router's usual path for it (`handle_inference`: auth, resolve,
make_servable, Admission.place, wait_slot, the retry rule) with the copy of the answer
replaced by `LeaseRelay` -- "worker, relay from this node" -- and writes the audit line and
the metrics once, when the worker reports `Done`, or when the lease ends without it
(client gone: 499; worker died: the connection drops the same way). Any other route a
worker receives is proxied to the main process's private HTTP socket `http.sock` (same app).
Both sockets live in a 0700 directory. Workers die with the main process (PR_SET_PDEATHSIG,
and SIGTERM at the main's exit); one that dies is restarted (workerset.py), a SIGHUP on
the main reaches them (each re-reads the configuration), and with Hub__TlsCert each wraps
the shared socket in its own TLS context from the same files.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from appliance.config import parse_listen
from appliance.http.asgi import BodyTooLarge
from appliance.http.errors import ApiError
from appliance.hub import translate
from appliance.hub.api.relay import SHUTTING_DOWN_RETRY_AFTER, NotAnswered
from appliance.hub.api.router import handle_inference
from appliance.hub.fleet.nodes import Flag
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
    LeaseError,
    Left,
)
from appliance.hub.workers.workerset import WorkerSet
from appliance.server.limits import Busy, ListenerRefusal, RequestTimeout
from appliance.server.serve import LISTEN_BACKLOG, StartupError

if TYPE_CHECKING:
    from appliance.hub.api.request import Request
    from appliance.hub.fleet.nodes import NodeHandle
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

WORKER_ENV = "APPLIANCE_HUB_WORKER"  # "FD:DIR" in a worker's environment
# A lease's frames: the body (Hub__MaxBodyBytes) and its headers.
FRAME_SLACK = 256 * 1024
# Past the workers' own drain, how long the main waits for them to exit.
STOP_SECONDS = 5.0


def bind_listener(listen: str) -> socket.socket:
    """The client listener, bound once here and shared with the workers."""
    host, port = parse_listen(listen, "Hub__Listen")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:
        raise StartupError(f"Hub__Listen={listen!r}: cannot listen: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def private_dir() -> str:
    return tempfile.mkdtemp(prefix="appliance-hub-")  # 0700


def starter(fd: int, where: str, env_file: str | None) -> Callable[[], Awaitable[Child]]:
    """How the main process starts one worker (workerset.py keeps them running)."""
    exe = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m",
                                                                   "appliance"]
    args = [*exe, "hub", "--log-level", logging.getLevelName(logging.getLogger().level)]
    if env_file:
        args += ["--env-file", env_file]
    env = {**os.environ, WORKER_ENV: f"{fd}:{where}"}

    async def start() -> Child:
        # Not trio's open_process: it forks from a thread of its pool, and a worker's
        # PR_SET_PDEATHSIG fires when that thread ends (seconds later), not the hub.
        return Child(subprocess.Popen(args, env=env, pass_fds=(fd,)))

    return start


class Child:
    """A worker process, awaited without blocking (its pidfd; else polled)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    async def wait(self) -> int:
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            pidfd = -1
        try:
            while self.popen.poll() is None:
                if pidfd >= 0:
                    await trio.lowlevel.wait_readable(pidfd)
                else:
                    await trio.sleep(0.2)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return self.popen.returncode

    def send_signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()


async def start_workers(hub: Hub, n: int, fd: int, where: str, env_file: str | None, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """The N-1 workers, kept running until the hub stops (`hub.workers`)."""
    ws = WorkerSet(n, starter(fd, where, env_file))
    hub.workers = ws
    hub.metrics_registry.register(ws)
    await ws.run(task_status=task_status)


async def drain_workers(stop: trio.Event, ws: WorkerSet | None) -> None:
    """A stop: the workers stop accepting and drain like the main (their SIGTERM)."""
    await stop.wait()
    if ws is not None:
        ws.drain()


async def reap_workers(ws: WorkerSet | None, where: str, seconds: float) -> None:
    """Wait (leases still answered meanwhile) for the workers' drain, then kill what is left."""
    if ws is not None:
        await ws.stop(seconds)
    shutil.rmtree(where, ignore_errors=True)


async def serve_leases(hub: Hub, path: str, *,
                       task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    listener = trio.SocketListener(await _unix_listener(path))
    task_status.started()
    await trio.serve_listeners(lambda s: _lease(hub, s), [listener])  # type: ignore[arg-type]


async def _unix_listener(path: str) -> trio.socket.SocketType:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    sock.listen(LISTEN_BACKLOG)
    return sock


_REFUSALS: dict[str, Callable[[], ListenerRefusal]] = {"request_timeout": RequestTimeout,
                                                     "busy": Busy}


async def _lease(hub: Hub, stream: trio.abc.Stream) -> None:
    """One worker connection: its leases, one after another (lease.py), each an inference
    request held by the worker -- the router's path, relayed by the worker."""
    conn = Conn(stream, hub.cfg.hub.max_body_bytes + FRAME_SLACK)
    gone = trio.Event()
    left = [False]  # the worker said its client went away (`Left`)
    inbox_in, inbox = trio.open_memory_channel[Any](4)
    current: list[LeaseRelay] = []  # the lease in progress

    async def reader() -> None:
        try:
            async with inbox_in:
                while True:
                    msg = await conn.recv()
                    if isinstance(msg, Left):
                        left[0] = True
                        gone.set()
                    else:
                        await inbox_in.send(msg)
        except GONE:
            pass
        finally:
            # While the worker relays, its silence is the relay's to report (worker_lost);
            # before (queued, loading), the router's disconnect: the client's if the worker
            # said so (`Left`), else the worker died holding it (hangup below).
            if not (current and current[0].relaying):
                gone.set()

    def hangup() -> tuple[int, str]:
        return (499, "client_disconnected") if left[0] else (502, "worker_lost")

    async with stream, trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        try:
            while True:
                try:
                    ask = await inbox.receive()
                except trio.EndOfChannel:
                    return
                if not isinstance(ask, Ask):
                    return
                relay = LeaseRelay(hub, conn, inbox, nursery, ask.seq, hangup)
                current[:] = [relay]
                if not await _one(hub, conn, ask, relay, gone) or gone.is_set():
                    return
        finally:
            nursery.cancel_scope.cancel()


async def _one(hub: Hub, conn: Conn, ask: Ask, relay: LeaseRelay, gone: trio.Event) -> bool:
    """One lease; True when it ended cleanly (the connection may carry the next)."""
    limit = hub.cfg.hub.max_body_bytes
    handed = False

    async def receive() -> dict[str, Any]:
        nonlocal handed
        if not handed:
            handed = True
            if ask.fail == "gone":
                raise trio.BrokenResourceError("client went away")
            if ask.fail in _REFUSALS:
                raise _REFUSALS[ask.fail]()
            if ask.fail == "too_large":  # the router's read_body answers 413 to it
                raise BodyTooLarge(limit + 1)
            return {"type": "http.request", "body": ask.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    start: dict[str, Any] = {}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            start.update(msg)
            return
        try:
            await conn.send(Answer(start.get("status", 500), list(start.get("headers", [])),
                                   bytes(msg.get("body", b""))))
        except GONE:
            pass

    scope = {"type": "http", "method": "POST", "path": ask.path,
             "headers": [(bytes(k), bytes(v)) for k, v in ask.headers], "state": {}}
    try:
        await handle_inference(hub.routing, scope, receive, send, ask.api, relay)
    except ListenerRefusal:
        return False  # recorded; the worker's listener answers it (and closes this)
    return ask.fail in ("", "too_large")


class LeaseRelay:
    """The router's way to relay a request held by a worker (router.Relaying): send `Go`,
    wait for its end. Never preemptible: its first byte is known here only at its end."""

    preemptible = False

    def __init__(self, hub: Hub, conn: Conn, inbox: trio.MemoryReceiveChannel[Any],
                 nursery: trio.Nursery | None = None, seq: int = 0,
                 hangup: Callable[[], tuple[int, str]] = lambda: (499,
                                                                  "client_disconnected")) -> None:
        self.hub, self.conn, self.inbox = hub, conn, inbox
        self.relaying = False  # a `Go` is out: the worker copies the answer
        self.nursery = nursery  # the connection's: where a `Cut` is sent from
        self.seq = seq
        self._hangup = hangup

    def hangup(self) -> tuple[int, str]:
        return self._hangup()

    async def relay(self, node: NodeHandle, req: Request, plan: translate.Plan) -> None:
        self.relaying = True
        try:
            await self._relay(node, req)
        finally:
            self.relaying = False

    async def _relay(self, node: NodeHandle, req: Request) -> None:
        # The worker sends these headers to the node beside its own: the per-node token,
        # and this request's trace context (the node's span a child of the hub's).
        extra = node.auth_raw + (req.trace.headers() if req.trace is not None else [])
        await self.conn.send(Go(node.name, node.url, extra,
                                translate.engine_kind(node.state), req.label))

        failure: ApiError | NotAnswered | None = None
        lost, drain = node.lost, self.hub.drain_over
        if isinstance(lost, Flag) and isinstance(drain, Flag) and self.nursery is not None:
            # The hub's own flags (nodes.Flag): a `Cut` is sent when one is set, no task
            # waits for it meanwhile.
            nursery = self.nursery
            on_lost = partial(nursery.start_soon, self._cut, node, "node_lost")
            on_drain = partial(nursery.start_soon, self._cut, node, "shutting_down")
            lost.subscribe(on_lost)
            drain.subscribe(on_drain)
            try:
                await self._end(node, req)
            except (ApiError, NotAnswered) as e:
                failure = e
            finally:
                lost.unsubscribe(on_lost)
                drain.unsubscribe(on_drain)
        else:
            async with trio.open_nursery() as watchers:
                watchers.start_soon(self._cut_when, lost, node, "node_lost")
                watchers.start_soon(self._cut_when, drain, node, "shutting_down")
                try:
                    await self._end(node, req)
                except (ApiError, NotAnswered) as e:  # raised outside: not an ExceptionGroup
                    failure = e
                finally:
                    watchers.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _cut(self, node: NodeHandle, reason: str) -> None:
        try:
            await self.conn.send(Cut(reason, node.lost_reason, self.seq))
        except GONE:
            pass

    async def _cut_when(self, ev: trio.Event | Flag, node: NodeHandle, reason: str) -> None:
        await ev.wait()
        await self._cut(node, reason)

    async def _end(self, node: NodeHandle, req: Request) -> None:
        """What the worker says next: done (returns), or failed before the first byte
        (NotAnswered)."""
        while True:
            try:
                msg = await self.inbox.receive()
            except trio.EndOfChannel:
                # The worker died (or was cut) holding the client: recorded as such, the
                # place given back as this returns.
                log.error("a hub worker's lease for %s on node %s dropped mid-request",
                          req.label, node.name)
                raise ApiError(502, "worker_lost",
                               "the hub worker relaying this request exited") from None
            if isinstance(msg, Failed):
                if msg.drain:
                    raise ApiError(503, "shutting_down", "the hub is shutting down; retry shortly",
                                   retry_after=SHUTTING_DOWN_RETRY_AFTER)
                raise NotAnswered(msg.why)
            if isinstance(msg, Done):
                req.answered(msg.node, msg.status, msg.ttfb)
                req.counted(msg.usage)
                if msg.error:
                    req.failed(msg.error)
                req.finish()
                try:
                    await self.conn.send(Ack())
                except GONE:
                    pass
                return
            raise LeaseError(f"unexpected {type(msg).__name__} from a worker")
