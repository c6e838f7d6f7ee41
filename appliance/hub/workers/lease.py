"""The lease: what a hub worker and the hub's main process say about one inference request.

Theory of operation (docs/hub-workers-design.md): with `Hub__Workers=N>1` every decision
stays in the main process and a worker only relays. Per inference request the worker opens
one connection to the main process's private Unix socket and holds it for the request's
life. Frames are a 4-byte big-endian length and one msgpack-encoded message below (tagged
structs). The worker asks (`Ask`: the request's path, headers and bounded body); the main
answers either with the whole answer (`Answer`: a refusal, Ollama's unload) or with a
place (`Go`: the node to relay from). A failed attempt before the first byte is `Failed`
(the main picks the next node and sends another `Go`, or refuses); the end is `Done` (what
the audit line says), acknowledged with `Ack` once the main wrote it, before the worker
sends the last byte. `Cut` tells the worker the node was declared lost or the drain ran
out. `Left` tells the main the client went away before the relay began; a connection that
ends without it before then was a worker dying (audited `worker_lost`). A connection that
ends gives the place back (the main's `async with place` exits).
A lease that ended cleanly (`Answer` replayed, or `Done` acknowledged) leaves its
connection open for the worker's next request: the next `Ask` starts the next lease on it
(no connect and accept per request); a `Cut` carries its lease's `seq`, so one sent as its
lease ended is not taken for the next one's.
"""

from __future__ import annotations

import struct

import msgspec
import trio

from appliance.hub.translate.usage import Usage

Headers = list[tuple[bytes, bytes]]


class Ask(msgspec.Struct, tag=True):
    path: str
    api: str
    headers: Headers
    body: bytes
    # "" read whole; "too_large"; "gone" (client left mid-body); a Refusal's code
    fail: str = ""
    seq: int = 0  # the lease's number on its connection (a `Cut` names it)


class Go(msgspec.Struct, tag=True):
    node: str
    url: str
    auth: Headers
    kind: str  # the node's engine kind (translate.engine_kind)
    model: str  # the resolved name


class Answer(msgspec.Struct, tag=True):
    status: int
    headers: Headers
    body: bytes


class Failed(msgspec.Struct, tag=True):
    why: str
    drain: bool = False  # cut by the end of the drain before the first byte


class Done(msgspec.Struct, tag=True):
    node: str
    status: int
    ttfb: float | None
    error: str
    # the answer's tokens (and the engine's word on its prompt cache), as the worker's
    # relay read them
    usage: Usage | None = None


class Ack(msgspec.Struct, tag=True):
    pass


class Left(msgspec.Struct, tag=True):
    """The worker's client went away before the relay began (queued, loading): a lease
    that ends without it was dropped by a dying worker (`worker_lost` in the audit)."""


class Cut(msgspec.Struct, tag=True):
    reason: str  # "node_lost" or "shutting_down"
    lost_reason: str = ""
    seq: int = 0  # the lease it is for: one sent as the lease ended is ignored by the next


Message = Ask | Go | Answer | Failed | Done | Ack | Cut | Left
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Message)
_LEN = struct.Struct(">I")


class LeaseError(Exception):
    """The other side closed or sent something that is not a lease message."""


class Conn:
    """Framed messages over one stream; `recv` refuses a frame over `max_bytes`."""

    def __init__(self, stream: trio.abc.Stream, max_bytes: int) -> None:
        self.stream = stream
        self.max_bytes = max_bytes
        self.seq = 0  # leases held on it so far (the worker's count)
        self._buf = bytearray()
        self._lock = trio.Lock()

    async def send(self, msg: Message) -> None:
        data = _enc.encode(msg)
        async with self._lock:
            await self.stream.send_all(_LEN.pack(len(data)) + data)

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(65536, n - len(self._buf)))
            if not chunk:
                raise LeaseError("connection closed")
            self._buf += chunk

    async def recv(self) -> Message:
        await self._fill(4)
        (n,) = _LEN.unpack(self._buf[:4])
        if n > self.max_bytes:
            raise LeaseError(f"frame of {n} bytes over {self.max_bytes}")
        await self._fill(4 + n)
        data = bytes(self._buf[4:4 + n])
        del self._buf[:4 + n]
        try:
            return _dec.decode(data)
        except msgspec.DecodeError as e:
            raise LeaseError(f"bad frame: {e}") from None


# Errors that mean "the other side is gone".
GONE = (LeaseError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)
