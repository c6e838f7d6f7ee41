"""Stored responses written behind: queued on the loop, committed in groups on the store's thread.

Theory of operation: an ordinary `POST /v1/responses` (`store` on by default) ends with one
new object and its input items. Written alone, each cost one thread hop and one SQLite
transaction -- about as much hub CPU as a fifth of the request. `Behind.put` queues it
instead (the store's bounds are checked and charged at once, as for any put) and `run`
commits what has queued in one transaction on one hop: GROUP_SECONDS after the first of a
group, or at once when GROUP_MAX have queued or a reader waits for one. A read of an id
still queued (`Store.get` calls `wait`) has its group committed first, so a client never
finds missing a response it was just given. A clean stop commits what is queued; a
kill -9 loses at most the last GROUP_SECONDS of stored responses (their answers had been
sent). A group that fails to commit (a full disk) is logged and its bytes given back.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from appliance.hub.store.db import Db, Obj

log = logging.getLogger("appliance.hub.store")

# A group commits this long after its first object, or at GROUP_MAX objects.
GROUP_SECONDS = 0.5
GROUP_MAX = 512
# What is queued at a clean stop is committed within this bound.
FLUSH_SECONDS = 10.0

Row = tuple[Obj, bytes, list[tuple[str, dict[str, Any]]]]  # the object, its data's JSON, items


class _Group:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.done = trio.Event()


class Behind:
    def __init__(self, db: Db, run: Callable[..., Awaitable[Any]],
                 uncharge: Callable[[Obj], None], committed: Callable[[], None]) -> None:
        self.db, self.run_sync, self.uncharge, self.committed = db, run, uncharge, committed
        self.group = _Group()
        self.queued: dict[str, _Group] = {}  # id -> the group that commits it
        self.first = trio.Event()  # the open group has something
        self.now = trio.Event()  # ... and should commit without waiting out GROUP_SECONDS
        self.running = False

    def put(self, o: Obj, data: bytes, items: list[tuple[str, dict[str, Any]]]) -> None:
        self.group.rows.append((o, data, items))
        self.queued[o.id] = self.group
        self.first.set()
        if len(self.group.rows) >= GROUP_MAX:
            self.now.set()

    async def wait(self, oid: str) -> None:
        """Return once `oid` (if it is queued) is committed."""
        g = self.queued.get(oid)
        if g is None:
            return
        if g is self.group:
            self.now.set()
        await g.done.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        self.running = True
        task_status.started()
        try:
            while True:
                await self.first.wait()
                with trio.move_on_after(GROUP_SECONDS):
                    await self.now.wait()
                await self.commit()
        finally:
            self.running = False
            with trio.CancelScope(shield=True), trio.move_on_after(FLUSH_SECONDS):
                await self.commit()

    async def commit(self) -> None:
        """Commit the open group (nothing queued: nothing done)."""
        g, self.group = self.group, _Group()
        self.first, self.now = trio.Event(), trio.Event()
        if not g.rows:
            return
        try:
            with trio.CancelScope(shield=True):  # what the clients were told is stored
                await self.run_sync(self.db.put_group, g.rows)
            log.debug("store: %d stored responses committed in one group", len(g.rows))
        except (OSError, sqlite3.Error) as e:
            log.warning("store: %d stored responses lost, their commit failed: %s", len(g.rows), e)
            for o, _, _ in g.rows:
                self.uncharge(o)
        finally:
            self.committed()
            for o, _, _ in g.rows:
                if self.queued.get(o.id) is g:
                    del self.queued[o.id]
            g.done.set()
