"""The proxy's HTTP/1.1 client (hub -> node, node -> engine): our wire code, our sockets, pooled.

Owns the request path's client and its connection pool. A general client spends most of
its time on features a proxy to a known peer never uses (redirects, cookies, decoding);
this one sends a request on a kept-alive connection and yields the body as raw chunks as
they arrive, nothing buffered or decoded. One decision is its own: a connection is reused
only when both sides finished the exchange cleanly. A pooled connection the peer closed
while idle fails before any byte of an answer: that alone is retried, once, on a fresh
one. Connections no longer needed are closed at once, never left to the garbage
collector (CLOSE-WAIT holds an fd): the extra over MAX_IDLE_PER_PEER, the expired, those
whose peer hung up (a peek when taken, and every SWEEP_SECONDS by `sweep_every`).
Every byte goes through a `Transport` (appliance/net/transport.py) on a socket connected
here (TLS: trio's SSLStream over it); heads are appliance/h1/parse.py's, bodies
appliance/h1/body.py's; a short answer whose body came with its head is handed over
whole (`Response.whole`: no read, no deadline). Connecting is bounded by CONNECT_SECONDS,
each read by the caller's `read_timeout` (Hub__UpstreamReadSeconds). The hub's control
calls to its nodes (hub/fleet/ops.py) and their watch streams (hub/fleet/supervisor.py)
take the same pool: one set of connections and one TLS setup per node; httpx stays for
ctl, etcd and engines. `open_socket` (a test's in-memory peer) replaces the TCP connect.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from urllib.parse import urlsplit

import trio

from appliance.h1.body import Body, BodyError, ChunkedBody, CloseBody, SizedBody, ends_at_close
from appliance.h1.parse import BrokenResponse, ResponseHead, encode_request, parse_response_head
from appliance.h1.state import CHUNKED, UNTIL_CLOSE
from appliance.http.stream import receive_within
from appliance.net.transport import TlsTransport, Transport, connect

# Connecting to a node on the LAN takes milliseconds; 5 s means it is not there.
CONNECT_SECONDS = 5.0
# Idle connections are closed well before the peer's keep-alive (75 s, appliance.http.asgi)
# would: a pool that outlives a load by 15 s at most, and never meets a peer's close.
IDLE_SECONDS = 15.0
# Closing a connection (a TLS close_notify) waits no longer than this.
CLOSE_SECONDS = 1.0
# Idle connections kept per peer; a burst opens more and closes the extra when it ends
# (a node runs a handful of requests per model at once; 16 covers that with room).
MAX_IDLE_PER_PEER = 16
# How often `sweep_every` closes idle connections that expired or whose peer closed them
# (a node's keep-alive ran out, the node restarted): a few seconds of CLOSE-WAIT at most.
SWEEP_SECONDS = 5.0
READ_BYTES = 65536

_Key = tuple[str, str, int]  # (scheme, host, port): one pool of idle connections each


class UpstreamError(Exception):
    """The node could not be reached, or the connection broke; `before_response` says when.

    The message is a verb phrase about the peer ("closed the connection before
    answering"), so a caller's log line reads "node gpu-a closed the connection ..."."""

    def __init__(self, message: str, before_response: bool = True) -> None:
        super().__init__(message)
        self.before_response = before_response


def _before_answer(e: BaseException, read_timeout: float) -> str:
    """What a failure before the response's head means, said for an operator."""
    if isinstance(e, trio.TooSlowError):
        return f"did not answer within {read_timeout:g} s"
    if isinstance(e, BrokenResponse):
        return f"sent a broken response ({e})"
    if isinstance(e, (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError)):
        return "closed the connection before answering"
    return f"failed before answering ({type(e).__name__}: {e})"


class _Conn:
    """One pooled connection: its transport, and since when it is idle."""

    __slots__ = ("transport", "idle_since")

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.idle_since = 0.0

    def peer_closed(self) -> bool:
        """An idle connection whose peer hung up (or sent what no request asked for)."""
        try:
            poller = select.poll()
            poller.register(self.transport.sock.fileno(),
                            select.POLLIN | select.POLLERR | select.POLLHUP)
            # Readable while idle: the end of the stream, or bytes no request asked for.
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return True

    def close_now(self) -> None:
        """Close without waiting (an idle connection has nothing to flush)."""
        self.transport.close()

    async def aclose(self) -> None:
        """Close, bounded (a TLS close_notify to a peer that does not read)."""
        with trio.move_on_after(CLOSE_SECONDS, shield=True):
            await self.transport.aclose()
        self.transport.close()


class Response:
    """Status and headers of a node's answer; the body as it arrives: `receive()` (one
    read's payload at a time, no deadline of its own: the caller's relay loop keeps one,
    appliance/http/stream.py) or `chunks()` (each read bounded by `read_timeout`).

    Every body is read by appliance/h1/body.py's reader for the head's framing (sized,
    chunked, or up to the close); the payload is passed on as it came."""

    def __init__(self, pool: Pool, key: _Key, conn: _Conn, head: ResponseHead,
                 read_timeout: float, early: bytes = b"") -> None:
        self._pool = pool
        self._key = key
        self._conn: _Conn | None = conn
        # The exchange is over: the connection went back to the pool or was closed.
        self.released = False
        self.read_timeout = read_timeout
        # trio time the read in progress (or the last one) began waiting: a relay's deadline.
        # A wait cancelled and taken up again (the relay's lazy deadline fired early) is the
        # same wait: `_waiting` keeps its start.
        self.waited_at = 0.0
        self._waiting = False
        self.status_code = head.status_code
        self.headers = head.headers
        self._body: Body = (ChunkedBody() if head.framing == CHUNKED
                            else CloseBody() if head.framing == UNTIL_CLOSE
                            else SizedBody(head.length))
        self._early = early  # body bytes that came with the head
        self._keep = head.keep_alive  # the connection may serve another request after this one

    async def receive(self) -> bytes:
        """The payload the next read brings (b"" once the body ended; at most one wait).
        Raises UpstreamError when the peer breaks off or breaks the framing; safe to cancel
        (nothing read is lost)."""
        conn = self._conn
        if conn is None:
            return b""
        body = self._body
        while True:
            if self._early:
                data, self._early = self._early, b""
            elif body.done:
                self._finish(body)
                return b""
            elif body.error is not None:
                data = b""  # the framing broke after the payload returned last: raise now
            else:
                if not self._waiting:  # not a wait a relay's lazy deadline interrupted
                    self._waiting = True
                    self.waited_at = trio.current_time()
                # (b"" at the end of the stream and when it broke: Transport's rule)
                data = await conn.transport.receive(READ_BYTES)
                self._waiting = False
                if not data:
                    if ends_at_close(body):  # a close-delimited body: its end
                        await self._discard()
                        return b""
                    await self._discard()
                    raise UpstreamError("closed the connection mid-response",
                                        before_response=False)
            try:
                out = body.feed(data)
            except BodyError as e:
                await self._discard()
                raise UpstreamError(f"broke off the response ({e})",
                                    before_response=False) from None
            if body.done:
                self._finish(body)
            if out:
                return out
            if self._conn is None:
                return b""

    async def timed_out(self) -> UpstreamError:
        """The error for a read that waited `read_timeout`; the connection is closed."""
        await self._discard()
        return UpstreamError(f"sent nothing for {self.read_timeout:g} s mid-response",
                             before_response=False)

    def whole(self) -> bytes | None:
        """The whole body when it came with the head (a short answer with its length: no
        read, no deadline, the connection back in the pool at once), else None."""
        body = self._body
        if (type(body) is SizedBody and self._conn is not None and self._early
                and body.remaining == len(self._early)):
            data, self._early = self._early, b""
            body.feed(data)
            self._finish(body)
            return data
        return None

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """The body as it arrives, each read bounded by `read_timeout`. Everything one
        read brought is yielded as one chunk: a node that is ahead of us costs one write
        to the client, not one per event."""
        while True:
            chunk = await receive_within(self)
            if not chunk:
                return
            yield chunk

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def _finish(self, body: Body) -> None:
        """The body ended by its framing: the connection goes back to the pool, unless the
        peer sent more than it framed or said it closes."""
        conn = self._conn
        if conn is None:
            return
        self._conn, self.released = None, True
        if body.leftover or self._early or not self._keep:
            conn.close_now()
        else:
            self._pool._put(self._key, conn)

    def _release(self) -> None:
        conn, self._conn, self.released = self._conn, None, True
        if conn is not None:
            if self._keep:
                self._pool._put(self._key, conn)
            else:
                conn.close_now()

    async def _discard(self) -> None:
        conn, self._conn, self.released = self._conn, None, True
        if conn is not None:
            await conn.aclose()

    async def aclose(self) -> None:
        """Done with it: a finished exchange goes back to the pool, anything else is closed."""
        conn = self._conn
        if conn is None:
            return
        body = self._body
        if body.done and not body.leftover and not self._early:
            self._release()
        else:
            await self._discard()


class Pool:
    def __init__(self, headers: dict[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None,
                 open_socket: Callable[[str, int], Awaitable[socket.socket]] = connect) -> None:
        self._idle: dict[_Key, list[_Conn]] = {}
        self._headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self._ssl = ssl_context
        self._open = open_socket  # a connected socket to (host, port); bounded by the caller

    def _put(self, key: _Key, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        idle = self._idle.setdefault(key, [])
        if len(idle) < MAX_IDLE_PER_PEER:
            idle.append(conn)
        else:
            conn.close_now()

    def sweep(self) -> int:
        """Close idle connections that expired or whose peer closed them; how many."""
        now = time.monotonic()
        closed = 0
        for key, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if now - conn.idle_since < IDLE_SECONDS and not conn.peer_closed():
                    keep.append(conn)
                else:
                    conn.close_now()
                    closed += 1
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        return closed

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def sweep_every(self, seconds: float = SWEEP_SECONDS) -> None:
        """`sweep` every `seconds`, until cancelled (in the owner's nursery)."""
        while True:
            await trio.sleep(seconds)
            self.sweep()

    async def _connect(self, key: _Key) -> _Conn:
        scheme, host, port = key
        try:
            with trio.fail_after(CONNECT_SECONDS):
                sock = await self._open(host, port)
                if scheme != "https":
                    return _Conn(Transport(sock))
                tls = TlsTransport(sock, self._ssl or ssl.create_default_context(),
                                   server_side=False, server_hostname=host)
                try:
                    await tls.handshake()
                except BaseException:
                    tls.close()
                    raise
                return _Conn(tls)
        except ConnectionRefusedError:
            raise UpstreamError(f"refused the connection at {host}:{port}") from None
        except trio.TooSlowError:
            raise UpstreamError(
                f"could not be connected to at {host}:{port} within {CONNECT_SECONDS:g} s"
            ) from None
        except OSError as e:
            raise UpstreamError(
                f"could not be connected to at {host}:{port} ({type(e).__name__}: {e})") from None

    async def request(self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes,
                      read_timeout: float) -> Response:
        """Send the request; return once the response's status and headers are in."""
        u = urlsplit(url)
        port = u.port or (443 if u.scheme == "https" else 80)
        if u.hostname is None:  # "http:///x": trio would raise ValueError (not ours to 500)
            raise UpstreamError(f"has no host in its URL {url!r}")
        key = (u.scheme, u.hostname, port)
        target = (u.path or "/") + (f"?{u.query}" if u.query else "")
        hdrs = [(b"host", f"{u.hostname}:{port}".encode())]
        if self._headers:  # the pool's own (a node token), unless the request says them
            given = {k for k, _ in headers}
            hdrs += [kv for kv in self._headers if kv[0] not in given]
        hdrs += headers
        conn: _Conn | None = None
        idle = self._idle.get(key)  # the newest idle connection still good, else a new one
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < IDLE_SECONDS and not conn.peer_closed():
                break
            conn.close_now()
            conn = None
        for attempt in (0, 1):
            if attempt == 1:
                conn = None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            try:
                return await self._exchange(key, conn, method, target, hdrs, body, read_timeout)
            except UpstreamError:
                if reused:
                    continue  # the node closed it while idle; once more on a fresh one
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, key: _Key, conn: _Conn, method: str, target: str,
                        hdrs: list[tuple[bytes, bytes]], body: bytes,
                        read_timeout: float) -> Response:
        try:
            # ValueError (a header that would split the request) goes through: our bug
            await conn.transport.send_all(encode_request(method, target, hdrs, len(body)) + body,
                                          shield=False)
            buf = b""
            while True:
                got = parse_response_head(buf, method == "HEAD")
                if got is None:
                    # fail_after's own layers (two context managers) cost more than the read
                    with trio.CancelScope(deadline=trio.current_time() + read_timeout) as cs:
                        data = await conn.transport.receive(READ_BYTES)
                    if cs.cancelled_caught:
                        raise trio.TooSlowError
                    if not data:
                        raise UpstreamError("closed the connection before answering")
                    buf += data
                    continue
                head, used = got
                if head.status_code < 200:
                    if head.status_code == 101:  # we never ask to switch protocols
                        raise BrokenResponse("101 Switching Protocols")
                    buf = buf[used:]  # 100 Continue, 103 Early Hints: the answer follows
                    continue
                return Response(self, key, conn, head, read_timeout, buf[used:])
        except UpstreamError:
            await conn.aclose()
            raise
        except (OSError, trio.TooSlowError, BrokenResponse) as e:
            await conn.aclose()
            raise UpstreamError(_before_answer(e, read_timeout)) from None
        except BaseException:
            await conn.aclose()
            raise

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await conn.aclose()
