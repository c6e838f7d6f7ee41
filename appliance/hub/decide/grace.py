"""The start-up grace: right after a (re)start the hub does not yet know its fleet.

Theory of operation: a hub that has just started knows its static nodes but has heard
from none of them, and knows announced nodes only as they announce. Refusing in that
moment -- `model_unplaceable` because no node is connected yet, 404 for a model only a
node can name -- tells clients something false that is fixed a second later. So until
every known node has answered once (its first NodeState), bounded by two heartbeat
timeouts (2 x 3 x `Node__HeartbeatSeconds`: a node that has not answered by then is
really away), a request for a model with no ready replica waits, as an activation
does, instead of being refused; it goes on as soon as a replica is ready or the grace
ends, and then takes the ordinary path (which may still refuse, truthfully now).

The decision (`over`) is plain code on the registry and the clock; `wait_settled` is
the only wait, woken by registry changes (no polling) and bounded by the grace's end.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from appliance.hub.fleet.nodes import MISSED_HEARTBEATS, Registry

# "Two heartbeat timeouts": one for the node's dial, one for its first state.
GRACE_TIMEOUTS = 2


class StartupGrace:
    def __init__(self, registry: Registry, heartbeat_seconds: float) -> None:
        self.registry = registry
        self.until = trio.current_time() + GRACE_TIMEOUTS * MISSED_HEARTBEATS * heartbeat_seconds
        self._over = False

    def over(self) -> bool:
        """Every known node answered once (and at least one is known), or the bound passed."""
        if self._over:
            return True
        nodes = [h for h in self.registry.nodes.values() if not h.removed]
        if (nodes and all(h.answered for h in nodes)) or trio.current_time() >= self.until:
            self._over = True
        return self._over

    async def wait_settled(self, ready: Callable[[], bool]) -> None:
        """Returns once `ready()` holds or the grace is over."""
        while not self.over() and not ready():
            with trio.move_on_at(self.until):
                await self.registry.wait_changed()
