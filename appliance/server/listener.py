"""Every listener's defences against clients that are slow, greedy or ambiguous.

Theory of operation: this module owns the accept loop (`serve_guarded`, which replaces
`hypercorn.trio.serve`). A plain-TCP connection is served by our lean HTTP/1.1 server
(appliance/server/connection.py: a task per connection, the app called in it, about a fifth of
hypercorn's CPU per request), which keeps every rule below natively. A TLS connection is
served by hypercorn (ALPN, HTTP/2), which parses HTTP/1.1 (h11) and runs the app but does
not bound how long a request head or body may take to arrive (its `read_timeout` is per
read, so one byte a second passes), how many connections are open, or how many body
bytes are held at once, and h11 frames a request that carries both `Transfer-Encoding`
and `Content-Length` by the former and keeps the connection: for those this module wraps
each connection and each request (`_GuardedStream`, `guard_app`), so the hub API, the
node API and both metrics listeners get the same rules on either path:

- A connection the client closed is let go at once (appliance/server/hyperfix.py), and the
  close hypercorn starts from the read side waits for an answer being written.
- At most `max_connections` connections are open. At the bound, a new client takes the
  place of the oldest connection that serves no request (idle, or still trickling its
  head); when every one is serving, the next waits in the kernel's backlog (no fd here).
- A request head must be complete within `header_read_seconds` of the connection's
  start, or of its first byte on a kept-alive connection (`_GuardedStream`); a partial
  head is answered 408 `request_timeout`, an idle connection is just closed.
- A body must be complete within `body_read_seconds` of the head: 408 and close.
- TE and CL together (RFC 9112 section 6.1): 400 and close, nothing behind it is read.
- The body bytes the apps hold at once are bounded by `max_buffered_bytes` per listener:
  a request that would pass it gets 503 `busy` with Retry-After and the connection is
  closed; its bytes are given back when its handler returns.

Errors are rendered in the shape the apps use (OpenAI's under /v1/, `{"error": ...}`
elsewhere). The decisions are plain (`Budget`, `framing_error`); the rest is trio shell.

The limits are live (`LiveLimits`): a reload (SIGHUP) `set`s new ones, and they apply to
what starts after it -- a new connection's head deadline and slot, a new request's head
and body deadlines (on a kept-alive connection too), the next body bytes' budget. What
already runs keeps its deadline; a connection open above a lowered bound is not closed
(new ones wait, or take an idle one's place as above).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HyperConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr

from appliance.http.errors import ApiError, api_of, render
from appliance.server.fastio import DIRECT_KEY, plain_socket

log = logging.getLogger("appliance.server.listener")

# ASGI's callables, messages as the untyped dicts they are.
_Receive = Callable[[], Awaitable[dict[str, Any]]]
_Send = Callable[[dict[str, Any]], Awaitable[None]]

MiB = 1024 * 1024
GUARD_KEY = "appliance.guard"
# Retry-After of a `busy` answer: bodies in flight finish within seconds on a LAN.
BUSY_RETRY_AFTER = 2
# errnos of accept() that mean "out of fds/memory now", as trio's serve_listeners lists them.
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
# After a request that held this much body, and once no body is held, freed heap is
# returned to the OS (`_trim`).
TRIM_AFTER_BYTES = 8 * MiB
# A request refused for its framing has at most this much of its body read first.
FRAMING_DRAIN_BYTES = 64 * 1024
# A 408 to a client that does not read is not worth more than this.
_WRITE_408_SECONDS = 1.0


@dataclass(frozen=True)
class Limits:
    header_read_seconds: float = 10.0
    body_read_seconds: float = 60.0
    max_connections: int = 4096
    max_buffered_bytes: int = 256 * MiB


class LiveLimits:
    """A listener's `Limits` as the last reload left them (read at each new connection and
    request); `set` replaces them and tells each running listener (`following`)."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.now = limits if limits is not None else Limits()
        self._followers: list[Callable[[Limits], None]] = []

    def set(self, limits: Limits) -> bool:
        """New limits from now on; whether they differ from the old ones."""
        changed, self.now = limits != self.now, limits
        for follow in list(self._followers):
            follow(limits)
        return changed

    @contextmanager
    def following(self, follow: Callable[[Limits], None]) -> Iterator[None]:
        """`follow(limits)` now and on every `set`, while the block runs."""
        self._followers.append(follow)
        try:
            follow(self.now)
            yield
        finally:
            self._followers.remove(follow)


def live_limits(limits: Limits | LiveLimits) -> LiveLimits:
    return limits if isinstance(limits, LiveLimits) else LiveLimits(limits)


class Refusal(Exception):
    """Raised out of an app's `receive`; the listener answers it (and closes). Apps with a
    catch-all let it through."""

    status = 0
    code = ""


class RequestTimeout(Refusal):
    status, code = 408, "request_timeout"


class Busy(Refusal):
    status, code = 503, "busy"


class Budget:
    """Body bytes held at once by one listener's requests."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held = max(0, self.held - n)


def framing_error(headers: list[tuple[bytes, bytes]]) -> str | None:
    """Why the request's framing is ambiguous (both TE and CL), else None."""
    names = {k.lower() for k, _ in headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        return "both Transfer-Encoding and Content-Length (RFC 9112 section 6.1)"
    return None


def _raw_408() -> bytes:
    # No head, so no path: OpenAI's shape.
    r = render(ApiError(408, "request_timeout", "request head not received in time"), "openai")
    return (b"HTTP/1.1 408 Request Timeout\r\n"
            + b"".join(k + b": " + v + b"\r\n" for k, v in r.headers)
            + b"connection: close\r\n\r\n" + r.body)


def _load_trim() -> Callable[..., Any]:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back
        return lambda *_: 0


_malloc_trim = _load_trim()


def _trim() -> None:
    """Hand freed heap back to the OS. glibc keeps the 64 KiB pieces a body arrives in as
    free heap, so after a burst of big bodies the process stayed hundreds of MB above its
    idle size; malloc_trim returns it (a few ms, only after a big body, only when no body
    is held any more)."""
    _malloc_trim(0)


# --- per connection ------------------------------------------------------------------------


class _Guard:
    """A connection's head deadline, shared by its stream (reads) and its requests."""

    def __init__(self, limits: LiveLimits | float) -> None:
        # a float: fixed (tests); a reload changes the next head's deadline
        self.limits = limits if isinstance(limits, LiveLimits) else LiveLimits(
            Limits(header_read_seconds=limits))
        self.deadline = trio.current_time() + self.header_seconds  # a new connection owes a head
        self.head_bytes = False
        self.in_request = False
        self.answered = False  # the request's response has ended: what comes next is a head
        self.scope: trio.CancelScope | None = None
        self.cancel = trio.CancelScope()  # the whole connection: shed at max_connections
        self.lean = False  # served by appliance/server/connection.py

    @property
    def header_seconds(self) -> float:
        return self.limits.now.header_read_seconds

    def _set(self, deadline: float) -> None:
        self.deadline = deadline
        if self.scope is not None:
            self.scope.deadline = deadline

    def request_started(self) -> None:
        self.in_request = True
        self.head_bytes = self.answered = False
        self._set(math.inf)

    def response_ended(self) -> None:
        self.answered = True

    def request_done(self) -> None:
        self.in_request = False
        # idle: hypercorn's keep-alive bound, and the next head byte starts ours -- or it
        # came already, while the request was finishing
        self._set(trio.current_time() + self.header_seconds if self.head_bytes else math.inf)

    def received(self, data: bytes | bytearray) -> None:
        if data and (self.answered or not self.in_request) and not self.head_bytes:
            self.head_bytes = True
            if not self.in_request and self.deadline == math.inf:
                self._set(trio.current_time() + self.header_seconds)


class _GuardedStream:
    """The accepted stream, its reads bounded by the guard's head deadline."""

    def __init__(self, inner: trio.abc.Stream, guard: _Guard) -> None:
        self._inner = inner
        self._guard = guard

    def __getattr__(self, name: str) -> Any:  # socket, do_handshake, send_all, aclose ...
        return getattr(self._inner, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        g = self._guard
        with trio.CancelScope(deadline=g.deadline) as cs:
            g.scope = cs
            try:
                data = await self._inner.receive_some(max_bytes)
            finally:
                g.scope = None
        if cs.cancelled_caught:
            if g.head_bytes:
                with trio.move_on_after(_WRITE_408_SECONDS):
                    try:
                        await self._inner.send_all(_raw_408())
                    except (trio.BrokenResourceError, trio.ClosedResourceError,
                            trio.BusyResourceError):
                        pass
            raise trio.BrokenResourceError("request head not received in time")
        g.received(data)
        return data


class _TCPServer(TCPServer):
    """hypercorn's connection (with appliance.server.hyperfix's prompt close), less one race."""

    async def _close(self) -> None:
        # hypercorn sends data under `send_lock` but its EOF without it: a close from the
        # read side (h11 refusing a pipelined request after our `connection: close`) then
        # cut into an answer being written (trio.BusyResourceError) and the answer was lost.
        async with self.send_lock:
            await super()._close()


# --- per request ---------------------------------------------------------------------------


def guard_app(app: Callable[..., Awaitable[None]], live: LiveLimits,
              budget: Budget) -> Callable[..., Awaitable[None]]:
    """The ASGI app behind the rules above (http scopes; others pass through)."""

    async def guarded(scope: dict[str, Any], receive: _Receive, send: _Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        guard: _Guard | None = (scope.get("state") or {}).get(GUARD_KEY)
        if guard is not None:
            guard.request_started()
        started = False
        held = 0
        body_done = False
        limits = live.now
        deadline = trio.current_time() + limits.body_read_seconds

        async def receive_guarded() -> dict[str, Any]:
            nonlocal body_done, held
            if body_done:
                return await receive()
            with trio.move_on_at(deadline) as cs:
                msg = await receive()
            if cs.cancelled_caught:
                raise RequestTimeout()
            if msg["type"] != "http.request" or not msg.get("more_body"):
                body_done = True
            n = len(msg.get("body", b""))
            if n:
                if not budget.take(n):
                    raise Busy()
                held += n
            return msg

        async def send_tracked(msg: dict[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            elif msg["type"] == "http.response.body" and not msg.get("more_body") and guard:
                guard.response_ended()
            await send(msg)

        async def refuse(e: ApiError) -> None:
            if started:
                return
            r = render(e, api_of(scope["path"]), [(b"connection", b"close")])
            await send({"type": "http.response.start", "status": r.status, "headers": r.headers})
            await send({"type": "http.response.body", "body": r.body})

        try:
            why = framing_error(scope["headers"])
            if why is not None:
                # Take what h11 framed as this body first (bounded), so the read side is
                # parked on whatever follows when the refusal goes out and the close comes.
                seen = 0
                while seen < FRAMING_DRAIN_BYTES:
                    msg = await receive_guarded()
                    seen += len(msg.get("body", b""))
                    if msg["type"] != "http.request" or not msg.get("more_body"):
                        break
                await trio.sleep(0)
                await refuse(ApiError(400, "invalid_request", f"ambiguous request framing: {why}"))
                return
            await app(scope, receive_guarded, send_tracked)
        except RequestTimeout:
            await refuse(ApiError(408, "request_timeout", f"request body not received within "
                                  f"{limits.body_read_seconds:g} s"))
        except Busy:
            log.warning("refusing a request body: %d bytes of bodies held, the bound is %d",
                        budget.held, budget.limit)
            await refuse(ApiError(503, "busy",
                                  "the server holds too many request bodies now; retry shortly",
                                  retry_after=BUSY_RETRY_AFTER))
        finally:
            budget.give(held)
            if held >= TRIM_AFTER_BYTES and budget.held == 0:
                _trim()
            if guard is not None:
                guard.request_done()

    return guarded


# --- the accept loop -----------------------------------------------------------------------


class _Shed:
    """At `max_connections`, a new client takes the place of the oldest connection that is
    not serving a request (idle, or still sending its head): otherwise clients that only
    trickle head bytes would make every new one wait out their head deadlines."""

    # One warning per minute at most while the listener sheds.
    LOG_EVERY = 60.0

    def __init__(self) -> None:
        self.count = 0
        self._logged = -math.inf

    def one(self, live: dict[_Guard, None], limit: int) -> bool:
        for g in live:
            if not g.in_request:
                del live[g]
                g.cancel.cancel()
                self.count += 1
                now = trio.current_time()
                if now - self._logged >= self.LOG_EVERY:
                    self._logged = now
                    log.warning(
                        "%d connections open (the bound): closing the oldest that serve no request "
                        "to "
                                "take new ones (%d so far)", limit, self.count)
                return True
        return False


class _Slots:
    """Open connections against `max_connections`, a bound a reload may move: a raised one
    lets waiting accepts through at once, a lowered one closes nothing."""

    def __init__(self, live: LiveLimits) -> None:
        self.live = live
        self.held = 0
        self._lot = trio.lowlevel.ParkingLot()

    def full(self) -> bool:
        return self.held >= self.live.now.max_connections

    async def acquire(self) -> None:
        while self.full():
            await self._lot.park()
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        self._lot.unpark()

    def wake(self) -> None:
        self._lot.unpark_all()


async def serve_guarded(app: Callable[..., Awaitable[None]], cfg: HyperConfig,
                        limits: Limits | LiveLimits, *,
                        shutdown_trigger: Callable[[], Awaitable[Any]], lean: bool = True,
                        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Like `hypercorn.trio.serve` (no lifespan), with the limits above (`LiveLimits`: a
    reload's new ones apply from then on); returns after the drain (`cfg.graceful_timeout`)
    once `shutdown_trigger` returned. Binding errors (OSError, ssl.SSLError) propagate
    before `started`. Plain connections are served by appliance/server/connection.py (`lean=False`:
    by hypercorn, as TLS ones are; bench/floor_app.py)."""
    live = live_limits(limits)
    sockets = cfg.create_sockets()
    ssl_context = cfg.create_ssl_context()
    listeners: list[trio.abc.Listener[trio.abc.Stream]] = []
    binds: list[str] = []
    for sock in sockets.secure_sockets:
        sock.listen(cfg.backlog)
        listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                          ssl_context,  # type: ignore[arg-type]  # secure: set
                                          https_compatible=True))
        binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
    for sock in sockets.insecure_sockets:
        sock.listen(cfg.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    from appliance.server import (
        connection as h1server,  # (it uses this module's rules: imported here)
    )

    context = WorkerContext(None)
    budget = Budget(live.now.max_buffered_bytes)
    wrapped = ASGIWrapper(guard_app(app, live, budget))
    shared = h1server.Shared(app, live, budget, keep_alive=cfg.keep_alive_timeout,
                             max_head=cfg.h11_max_incomplete_size,
                             max_requests=cfg.keep_alive_max_requests)
    slots = _Slots(live)

    def follow(new: Limits) -> None:  # a reload: what is not read per connection or request
        budget.limit = new.max_buffered_bytes
        cfg.ssl_handshake_timeout = new.header_read_seconds  # hypercorn reads it per handshake
        slots.wake()

    live_conns: dict[_Guard, None] = {}  # open connections, oldest first
    shed = _Shed()

    async def connection(stream: trio.abc.Stream) -> None:
        guard = _Guard(live)
        live_conns[guard] = None
        try:
            with guard.cancel:
                sock = plain_socket(stream) if lean else None
                if sock is not None:  # plain HTTP/1.1: the lean server (server/connection.py)
                    guard.lean = True
                    async with stream:
                        await h1server.Conn(sock, shared, guard).run()
                    return
                # closed whatever TCPServer did (a failed handshake returns early)
                async with stream:
                    state: dict[str, Any] = {GUARD_KEY: guard}
                    server = _TCPServer(wrapped, cfg, context, state,
                                        _GuardedStream(stream, guard))  # type: ignore[arg-type]
                    state[DIRECT_KEY] = server  # a streamed body's fast path (http/fastio.py)
                    await server
        finally:
            live_conns.pop(guard, None)
            slots.release()

    async def accept_loop(listener: trio.abc.Listener[trio.abc.Stream],
                          handlers: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as e:
                if e.errno not in _ACCEPT_CAPACITY:
                    raise
                log.error("accept failed (%s); pausing 100 ms", errno.errorcode.get(e.errno,
                                                                                    e.errno))
                await trio.sleep(0.1)
                continue
            try:
                if slots.full():
                    shed.one(live_conns, live.now.max_connections)
                await slots.acquire()
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
            handlers.start_soon(connection, stream)

    with live.following(follow):
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(accept_loop, listener, handlers)
                    task_status.started(binds)
                    await shutdown_trigger()
                    acceptors.cancel_scope.cancel()
            finally:
                for listener in listeners:
                    with trio.CancelScope(shield=True):
                        await listener.aclose()
                await context.terminated.set()
                shared.terminating = True  # lean connections: idle ones close now, busy ones after
                for g in list(live_conns):
                    if g.lean and not g.in_request:
                        g.cancel.cancel()
                handlers.cancel_scope.deadline = trio.current_time() + cfg.graceful_timeout
