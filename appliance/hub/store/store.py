"""The store as the hub's trio code sees it: `Db` run off the loop, files on disk, bounds.

Theory of operation: `open_store` opens the SQLite file at `Store__Path` (created on first
use, with `files/` beside it for uploads and batch outputs) and hands back a `Store`; every
call runs `Db` on a worker thread, one at a time (`trio.to_thread.run_sync` with a
limiter of 1: one connection, never shared between threads at once). The store keeps the
running total of its bytes in memory (counted once at open) so a bound is checked without
a query: an upload or a stored object that would pass `Store__MaxTotalMb` is refused 507
`store_full`, as is one the disk cannot take; what was stored before stays. `sweep` drops
what has expired (files and batch outputs by their own `expires_at`, responses after
`Store__ResponseDays`). It decides no ownership: hub/api/objects.py does.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import msgspec
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.config import StoreConfig
from appliance.http.errors import ApiError
from appliance.hub.store.behind import Behind
from appliance.hub.store.db import Db, Obj

log = logging.getLogger("appliance.hub.store")

T = TypeVar("T")
MiB = 1024 * 1024
# Expired objects are looked for this often; OpenAI's expiries are hours to days.
SWEEP_SECONDS = 600.0


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.bytes = Gauge("appliance_store_bytes", "Bytes held by the store (files, batches, "
                           "responses, conversations)", registry=registry)
        self.lines = Counter("appliance_batch_lines_total", "Batch lines finished, by outcome",
                             ["outcome"], registry=registry)
        for outcome in ("completed", "failed", "cancelled", "expired"):
            self.lines.labels(outcome)


class Store:
    def __init__(self, db: Db, cfg: StoreConfig, hub: str, metrics: StoreMetrics) -> None:
        self.db = db
        self.cfg = cfg
        self.hub = hub
        self.metrics = metrics
        self.dir = os.path.join(os.path.dirname(os.path.abspath(cfg.path)), "files")
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.limiter = trio.CapacityLimiter(1)
        self.total = 0
        self.owned: dict[str, int] = {}  # objects per owner, once asked (check_quota)
        # stored responses (behind.py); the bytes gauge set once a group
        self.behind = Behind(db, self.run, self._uncharge, lambda: self.charge(0))

    def reload(self, cfg: StoreConfig) -> None:
        """New bounds (SIGHUP); the path stays the one opened."""
        self.cfg = msgspec.structs.replace(cfg, path=self.cfg.path)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(partial(fn, *args), limiter=self.limiter)

    # --- bytes ---------------------------------------------------------------------------

    @property
    def max_total(self) -> int:
        return self.cfg.max_total_mb * MiB

    @property
    def max_file(self) -> int:
        return self.cfg.max_file_mb * MiB

    def room(self, n: int) -> None:
        """Raise 507 `store_full` unless `n` more bytes fit under Store__MaxTotalMb."""
        if self.total + n > self.max_total:
            raise ApiError(507, "store_full",
                           f"the store is full ({self.total // MiB} MiB of Store__MaxTotalMb="
                           f"{self.cfg.max_total_mb}); delete files or batches to make room")

    def charge(self, n: int) -> None:
        self.total = max(0, self.total + n)
        self.metrics.bytes.set(self.total)

    def file_path(self, oid: str) -> str:
        return os.path.join(self.dir, oid)

    # --- objects -------------------------------------------------------------------------

    async def put(self, o: Obj, items: list[tuple[str, dict[str, Any]]] | None = None) -> None:
        """A new object (and its items, in the same transaction)."""
        self.room(o.bytes)
        await self.run(self.db.put_with_items, o, items or [])
        self.charge(o.bytes)
        if o.owner in self.owned:
            self.owned[o.owner] += 1

    async def put_behind(self, o: Obj, items: list[tuple[str, dict[str, Any]]],
                         data: bytes) -> None:
        """A new object (`data`: its fields as JSON) committed with others in one group
        soon (behind.py); read back at once through `get`. Without the group writer
        running: put now. The bytes gauge follows at the group's commit."""
        if not self.behind.running:
            await self.put(o, items)
            return
        self.room(o.bytes)
        self.total += o.bytes
        if o.owner in self.owned:
            self.owned[o.owner] += 1
        self.behind.put(o, data, items)

    def _uncharge(self, o: Obj) -> None:
        self.charge(-o.bytes)
        if o.owner in self.owned:
            self.owned[o.owner] -= 1

    async def get(self, kind: str, oid: str, owner: str | None) -> Obj | None:
        """The object (one still queued behind is committed first), or None."""
        await self.behind.wait(oid)
        return await self.run(self.db.get, kind, oid, owner)

    async def remove(self, o: Obj) -> None:
        """The object, its lines or items, and its file on disk."""
        await self.run(self.db.delete, o.id)
        if o.owner in self.owned:
            self.owned[o.owner] -= 1
        if o.kind == "file":
            await self.run(_unlink, self.file_path(o.id))
        self.total = await self.run(self.db.total_bytes)
        self.charge(0)

    async def check_quota(self, owner: str) -> None:
        if owner not in self.owned:  # counted once, then kept by put and remove
            self.owned[owner] = await self.run(self.db.count, owner)
        most = self.cfg.max_objects_per_key
        if self.owned[owner] >= most:
            raise ApiError(507, "store_full", f"this key holds {most} objects, the most one key "
                           "may (Store__MaxObjectsPerKey); delete some first")

    async def sweep(self) -> None:
        """Drop what has expired, a bounded number at a time."""
        while True:
            gone = await self.run(self.db.expired, int(time.time()))
            for o in gone:
                if o.kind == "batch" and o.state not in FINISHED:
                    continue  # the runner expires it and writes its files first
                await self.remove(o)
            if len(gone) < 1000:
                return

    async def sweep_every(self) -> None:
        while True:
            try:
                await self.sweep()
            except (OSError, sqlite3.Error) as e:
                log.warning("store: sweeping expired objects failed: %s", e)
            await trio.sleep(SWEEP_SECONDS)


FINISHED = ("completed", "failed", "expired", "cancelled", "ended")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def wanted(cfg: StoreConfig) -> bool:
    """Whether this hub keeps a store at all: a path is set (empty: its routes answer 501)."""
    return bool(cfg.path)


def open_store(cfg: StoreConfig, hub: str, registry: CollectorRegistry) -> Store | None:
    """The store at cfg.path, or None (empty path; a path it cannot open: logged)."""
    if not cfg.path:
        return None
    try:
        db = Db(cfg.path)
        store = Store(db, cfg, hub, StoreMetrics(registry))
        store.total = db.total_bytes()
        store.charge(0)
    except (OSError, sqlite3.Error) as e:
        log.warning("the store at Store__Path=%s cannot be opened (%s): files, batches and "
                    "stored responses answer 501 store_disabled", cfg.path, e)
        return None
    log.info("store at %s (%d MiB held)", cfg.path, store.total // MiB)
    return store
