"""The node's control API as the hub calls it: load, unload, pause/resume/leave/join, epoch.

Owns the calls and how their answers read: 200 is done, 409 `stale_leader` is
`StaleLeader`, any other status is `NodeRefused` with the node's (or its engine's) own
words; a transport failure stays an `httpx.TransportError`. `NodeGone` is the control
loop's own "that node cannot take this load" (gone, or its victim took work). Each call
has its bound here; it decides nothing (decide/control.py does).
"""

from __future__ import annotations

import urllib.parse

import httpx
import msgspec

from appliance.hub.fleet.nodes import NodeHandle
from appliance.wire import EPOCH_HEADER, HUB_HEADER, LEASE_HEADER, LoadRequest

# Connecting to a node on the LAN: a few seconds or it is not there.
CONNECT_SECONDS = 10.0
# An unload or a pause/resume is quick on any engine; a minute is already a sick node.
UNLOAD_SECONDS = 60.0
CONTROL_SECONDS = 10.0
_enc = msgspec.json.Encoder()


def _error_of(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict):
            err = err.get("message")
        if err:
            return str(err)
    except (ValueError, AttributeError):
        pass
    return f"node answered {resp.status_code}: {resp.text[:300]}"


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
    """The node's control API over the hub's shared node client (node token included).
    `epoch`: the leader's epoch sent with every load and unload (HA fencing); None alone;
    `lease`: its lease length, sent beside it (node/fence.py)."""

    def __init__(self, client: httpx.AsyncClient, hub: str = "") -> None:
        self.client = client
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

    async def assert_epoch(self, h: NodeHandle) -> None:
        """The leader's epoch re-asserted to `h` (each tick): records on `h` the epoch the
        node keeps and, when it refuses ours, why (`h.fenced`). Raises httpx.TransportError."""
        resp = await self.client.post(f"{h.url}/node/v1/epoch", headers=self._headers(**h.auth),
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=CONTROL_SECONDS))
        try:
            epoch = resp.json().get("epoch")
        except (ValueError, AttributeError):
            epoch = None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and 0 <= epoch < 2**63:
            h.epoch = epoch
        h.fenced = "" if resp.status_code == 200 else _error_of(resp)[:300]

    @staticmethod
    def _answer(resp: httpx.Response, stale: bool = True) -> None:
        if resp.status_code == 409 and stale:
            raise StaleLeader(_error_of(resp))
        if resp.status_code != 200:
            raise NodeRefused(resp.status_code, _error_of(resp))

    async def load(self, h: NodeHandle, model: str, req: LoadRequest,
                   read_seconds: float) -> None:
        """Returns once ready. Raises NodeRefused (the engine's own words), StaleLeader,
        httpx.TransportError."""
        resp = await self.client.post(
            f"{h.url}/node/v1/models/{urllib.parse.quote(model, safe='')}/load",
            content=_enc.encode(req),
            headers=self._headers(**{"content-type": "application/json"}, **h.auth),
            timeout=httpx.Timeout(CONNECT_SECONDS, read=read_seconds))
        self._answer(resp)

    async def unload(self, h: NodeHandle, model: str) -> None:
        """Raises as `load` does."""
        resp = await self.client.post(
            f"{h.url}/node/v1/models/{urllib.parse.quote(model, safe='')}/unload",
                                      headers=self._headers(**h.auth),
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=UNLOAD_SECONDS))
        self._answer(resp)

    async def control(self, h: NodeHandle, action: str) -> None:
        """`pause`/`resume`/`leave`/`join`. Raises NodeRefused, httpx.TransportError."""
        resp = await self.client.post(f"{h.url}/node/v1/{action}", headers=h.auth,
                                      timeout=httpx.Timeout(CONNECT_SECONDS, read=CONTROL_SECONDS))
        self._answer(resp, stale=False)
