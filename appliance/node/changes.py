"""Waiting for the node's state to change: the trio side of `NodeStateKeeper`.

Theory of operation: the keeper (state.py) is plain synchronous code; on every change it
calls its listeners. `ChangeWaiter` is one of them: it swaps a `trio.Event` per change,
so `wait_changed(since)` wakes whoever waits (the watch stream) without polling.
"""

from __future__ import annotations

import trio

from appliance.node.state import NodeStateKeeper


class ChangeWaiter:
    def __init__(self, keeper: NodeStateKeeper) -> None:
        self.keeper = keeper
        self._event = trio.Event()
        keeper.add_listener(self._wake)

    def _wake(self) -> None:
        ev, self._event = self._event, trio.Event()
        ev.set()

    async def wait_changed(self, since: int) -> None:
        """Return once the keeper's `version` differs from `since` (at once if it does)."""
        while self.keeper.version == since:
            await self._event.wait()
