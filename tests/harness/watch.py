"""The hub's supervisor of one node (appliance/hub/fleet/supervisor.py) in-process, its HTTP
answered by a test's httpx MockTransport handler: what a node's watch stream says, or how
it fails, on trio's virtual clock."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial

import httpx
import trio

from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.hub.fleet.supervisor import supervise


@dataclass
class Supervised:
    reg: Registry
    h: NodeHandle
    # What the supervisor said: (event, virtual seconds since the block began, reason).
    events: list[tuple[str, float, str]] = field(default_factory=list)


@asynccontextmanager
async def supervising(handler: Callable[[httpx.Request],
                                        httpx.Response | Awaitable[httpx.Response]], *,
                      name: str = "a", static: bool = True, connected: bool = False,
                      backoff_max: float = 30.0) -> AsyncIterator[Supervised]:
    """Node `name` (at http://NAME:1, heartbeat 2 s) supervised while the block runs."""
    reg = Registry()
    h, _ = reg.upsert(name, f"http://{name}:1", static=static)
    h.connected = connected
    s = Supervised(reg, h)
    start = trio.current_time()

    def said(kind: str, node: NodeHandle, reason: str) -> None:
        s.events.append((kind, trio.current_time() - start, reason))

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(supervise, client, h, reg, heartbeat=2.0,
                                       backoff_max=backoff_max, on_event=said))
            yield s
            nursery.cancel_scope.cancel()
