"""The node's control API as the hub calls it: load, unload, pause/resume/leave/join, epoch.

Owns the calls and how their answers read: 200 is done, 409 `stale_leader` is
`StaleLeader`, any other status is `NodeRefused` with the node's (or its engine's) own
words; a node not reached, or one that broke off, is the request path's `UpstreamError`.
`NodeGone` is the control loop's own "that node cannot take this load" (gone, or its
victim took work). The calls go through the request path's pool (appliance/client/
upstream.py: one pool of connections and one TLS setup for every node, the node token
in its headers); each has its bound here; it decides nothing (decide/control.py does).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

import msgspec

from appliance.client.upstream import CONNECT_SECONDS, Pool
from appliance.http.stream import receive_within
from appliance.hub.fleet.nodes import NodeHandle
from appliance.wire import EPOCH_HEADER, HUB_HEADER, LEASE_HEADER, LoadRequest

# An unload or a pause/resume is quick on any engine; a minute is already a sick node.
UNLOAD_SECONDS = 60.0
CONTROL_SECONDS = 10.0
# A control answer is a short JSON object: no more of it than this is read.
MAX_ANSWER_BYTES = 64 * 1024
_enc = msgspec.json.Encoder()
# (each call also waits up to the pool's CONNECT_SECONDS for a connection)
__all__ = ["CONNECT_SECONDS", "NodeGone", "NodeOps", "NodeRefused", "StaleLeader"]
_JSON = {"content-type": "application/json"}


class Answer:
    """A node's answer to a control call: its status and (up to MAX_ANSWER_BYTES) body."""

    __slots__ = ("status_code", "body")

    def __init__(self, status_code: int, body: bytes) -> None:
        self.status_code = status_code
        self.body = body

    def json(self) -> Any:
        try:
            return msgspec.json.decode(self.body)
        except msgspec.DecodeError:
            return None


def _error_of(resp: Answer) -> str:
    doc = resp.json()
    err = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(err, dict):
        err = err.get("message")
    if err:
        return str(err)
    text = resp.body[:300].decode("utf-8", "replace")
    return f"node answered {resp.status_code}: {text}"


class NodeRefused(Exception):
    """The node answered a control call with an error; the message is its (or its
    engine's) own words, `status` the HTTP status."""

    def __init__(self, status: int, words: str) -> None:
        super().__init__(words)
        self.status = status


class StaleLeader(Exception):
    """A node refused a load/unload: it has seen a newer leader's epoch."""


class NodeGone(Exception):
    """The node a load was planned for cannot take it any more: it left the registry, or
    a model to be unloaded for room took work meanwhile."""


class NodeOps:
    """The node's control API over the request path's pool (node token included).
    `epoch`: the leader's epoch sent with every load and unload (HA fencing); None alone;
    `lease`: its lease length, sent beside it (node/fence.py)."""

    def __init__(self, pool: Pool, hub: str = "") -> None:
        self.pool = pool
        self.hub = hub  # this hub's name, sent with every order (the node says who orders)
        self.epoch: int | None = None
        self.lease = 0.0

    def _headers(self, **extra: str) -> dict[str, str]:
        if self.hub:
            extra[HUB_HEADER] = self.hub
        if self.epoch is not None:
            extra[EPOCH_HEADER] = str(self.epoch)
            if self.lease:
                extra[LEASE_HEADER] = f"{self.lease:g}"
        return extra

    async def _post(self, h: NodeHandle, path: str, read_seconds: float, body: bytes = b"",
                    headers: dict[str, str] | None = None) -> Answer:
        """POST `path` to `h`; its answer (each read bounded by `read_seconds`). Raises
        UpstreamError."""
        hdrs = [(k.encode("latin-1"), v.encode("latin-1"))
                for k, v in (headers if headers is not None else h.auth).items()]
        resp = await self.pool.request("POST", h.url + path, hdrs, body, read_seconds)
        try:
            data = resp.whole()
            if data is None:
                parts: list[bytes] = []
                got = 0
                while got < MAX_ANSWER_BYTES:  # (past it the rest is not read: closed)
                    chunk = await receive_within(resp)
                    if not chunk:
                        break
                    parts.append(chunk)
                    got += len(chunk)
                data = b"".join(parts)[:MAX_ANSWER_BYTES]
        finally:
            await resp.aclose()
        return Answer(resp.status_code, data)

    async def assert_epoch(self, h: NodeHandle) -> None:
        """The leader's epoch re-asserted to `h` (each tick): records on `h` the epoch the
        node keeps and, when it refuses ours, why (`h.fenced`). Raises UpstreamError."""
        resp = await self._post(h, "/node/v1/epoch", CONTROL_SECONDS,
                                headers=self._headers(**h.auth))
        doc = resp.json()
        epoch = doc.get("epoch") if isinstance(doc, dict) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**63:
            h.epoch = epoch
        h.fenced = "" if resp.status_code == 200 else _error_of(resp)[:300]

    @staticmethod
    def _answer(resp: Answer, stale: bool = True) -> None:
        if resp.status_code == 409 and stale:
            raise StaleLeader(_error_of(resp))
        if resp.status_code != 200:
            raise NodeRefused(resp.status_code, _error_of(resp))

    async def load(self, h: NodeHandle, model: str, req: LoadRequest,
                   read_seconds: float) -> None:
        """Returns once ready. Raises NodeRefused (the engine's own words), StaleLeader,
        UpstreamError."""
        resp = await self._post(h, f"/node/v1/models/{urllib.parse.quote(model, safe='')}/load",
                                read_seconds, _enc.encode(req),
                                self._headers(**_JSON, **h.auth))
        self._answer(resp)

    async def unload(self, h: NodeHandle, model: str) -> None:
        """Raises as `load` does."""
        resp = await self._post(h, f"/node/v1/models/{urllib.parse.quote(model, safe='')}/unload",
                                UNLOAD_SECONDS, headers=self._headers(**h.auth))
        self._answer(resp)

    async def control(self, h: NodeHandle, action: str) -> None:
        """`pause`/`resume`/`leave`/`join`. Raises NodeRefused, UpstreamError."""
        resp = await self._post(h, f"/node/v1/{action}", CONTROL_SECONDS)
        self._answer(resp, stale=False)
