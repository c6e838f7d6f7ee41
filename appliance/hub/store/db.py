"""The store's tables: plain synchronous SQLite, no trio, tested by calling it.

Theory of operation: one file (`Store__Path`) in WAL mode with `synchronous=NORMAL`: a
commit survives the hub being killed (-9 included); a power cut may lose the last
commits, never corrupt the file. Three tables:
- `objects`: every file, batch, stored response and conversation -- id, kind, owner (the
  client name of the key that made it), times, its bytes, a `state` (a batch's status) and
  its fields as JSON.
- `lines`: a batch's lines -- the request as checked, then its result; `state` is
  `pending` until the line's result is committed, so a resumed batch runs only those.
- `items`: ordered items under a parent (a conversation's items, a response's input).
Ownership is a WHERE clause: `owner=None` is the admin, who sees every owner's objects.
The trio side (`store.py`) runs these on one worker thread at a time.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

SCHEMA = """
CREATE TABLE IF NOT EXISTS objects(
  id TEXT PRIMARY KEY, kind TEXT NOT NULL, owner TEXT NOT NULL, created_at INTEGER NOT NULL,
  expires_at INTEGER, bytes INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT '',
  data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS objects_by_kind ON objects(kind, owner, created_at);
CREATE INDEX IF NOT EXISTS objects_by_state ON objects(kind, state);
CREATE TABLE IF NOT EXISTS lines(
  batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, state TEXT NOT NULL,
  request TEXT, result TEXT, PRIMARY KEY(batch_id, idx));
CREATE TABLE IF NOT EXISTS items(
  parent TEXT NOT NULL, seq INTEGER NOT NULL, id TEXT NOT NULL, data TEXT NOT NULL,
  PRIMARY KEY(parent, seq));
CREATE INDEX IF NOT EXISTS items_by_id ON items(parent, id);
"""
# A writer waits this long for another process's lock (a hub worker, `ctl` reading).
BUSY_MS = 10_000


@dataclass
class Obj:
    id: str
    kind: str
    owner: str
    created_at: int
    expires_at: int | None
    bytes: int
    state: str
    data: dict[str, Any]


def _obj(row: tuple[Any, ...]) -> Obj:
    return Obj(row[0], row[1], row[2], row[3], row[4], row[5], row[6],
               msgspec.json.decode(row[7]))


_COLS = "id, kind, owner, created_at, expires_at, bytes, state, data"


def _owned(owner: str | None) -> tuple[str, tuple[Any, ...]]:
    return ("", ()) if owner is None else (" AND owner=?", (owner,))


class Db:
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None,
                                    timeout=BUSY_MS / 1000)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    # --- objects -------------------------------------------------------------------------

    def put(self, o: Obj) -> None:
        self.conn.execute(f"INSERT INTO objects({_COLS}) VALUES (?,?,?,?,?,?,?,?)",
                          (o.id, o.kind, o.owner, o.created_at, o.expires_at, o.bytes, o.state,
                           msgspec.json.encode(o.data).decode()))

    def put_with_items(self, o: Obj, items: list[tuple[str, dict[str, Any]]]) -> None:
        with self.conn:
            self.put(o)
            if items:
                self._add_items(o.id, items)

    def put_group(self, group: list[tuple[Obj, bytes, list[tuple[str, dict[str, Any]]]]]
                  ) -> None:
        """New objects (each with its fields' JSON) and their items (new parents: numbered
        from 0), in one transaction of two statements (hub/store/behind.py)."""
        enc = msgspec.json.encode
        with self.conn:
            self.conn.executemany(f"INSERT INTO objects({_COLS}) VALUES (?,?,?,?,?,?,?,?)",
                                  [(o.id, o.kind, o.owner, o.created_at, o.expires_at, o.bytes,
                                    o.state, data.decode()) for o, data, _ in group])
            self.conn.executemany("INSERT INTO items(parent, seq, id, data) VALUES (?,?,?,?)",
                                  [(o.id, i, iid, enc(d).decode()) for o, _, items in group
                                   for i, (iid, d) in enumerate(items)])

    def save(self, o: Obj) -> None:
        """Write back an object's state, bytes, expiry and fields."""
        self.conn.execute("UPDATE objects SET state=?, bytes=?, expires_at=?, data=? WHERE id=?",
                          (o.state, o.bytes, o.expires_at, msgspec.json.encode(o.data).decode(),
                           o.id))

    def get(self, kind: str, oid: str, owner: str | None) -> Obj | None:
        where, args = _owned(owner)
        row = self.conn.execute(f"SELECT {_COLS} FROM objects WHERE id=? AND kind=?{where}",
                                (oid, kind, *args)).fetchone()
        return _obj(row) if row else None

    def page(self, kind: str, owner: str | None, after: str | None, limit: int,
             newest_first: bool = True, extra: str = "",
             extra_args: tuple[Any, ...] = (), after_at: int | None = None,
             ) -> tuple[list[Obj], bool]:
        """Up to `limit` objects after the one with id `after`, and whether there are more.
        `after_at`: the cursor's creation time, for one another hub holds (a merged list)."""
        where, args = _owned(owner)
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        if after:
            row = self.conn.execute("SELECT created_at, id FROM objects WHERE id=?",
                                    (after,)).fetchone()
            if row is None and after_at is not None:
                row = (after_at, after)
            if row:
                where += f" AND (created_at, id) {cmp} (?, ?)"
                args = (*args, row[0], row[1])
        rows = self.conn.execute(
            f"SELECT {_COLS} FROM objects WHERE kind=?{where}{extra} "
            f"ORDER BY created_at {order}, id {order} LIMIT ?",
            (kind, *args, *extra_args, limit + 1)).fetchall()
        return [_obj(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, oid: str) -> None:
        with self.conn:
            self.conn.execute("DELETE FROM objects WHERE id=?", (oid,))
            self.conn.execute("DELETE FROM lines WHERE batch_id=?", (oid,))
            self.conn.execute("DELETE FROM items WHERE parent=?", (oid,))

    def in_state(self, kind: str, states: Iterable[str]) -> list[Obj]:
        marks = ",".join("?" * len(list(states)))
        rows = self.conn.execute(f"SELECT {_COLS} FROM objects WHERE kind=? AND state IN "
                                 f"({marks}) ORDER BY created_at", (kind, *states)).fetchall()
        return [_obj(r) for r in rows]

    def expired(self, now: int, limit: int = 1000) -> list[Obj]:
        rows = self.conn.execute(f"SELECT {_COLS} FROM objects WHERE expires_at IS NOT NULL "
                                 f"AND expires_at <= ? LIMIT ?", (now, limit)).fetchall()
        return [_obj(r) for r in rows]

    def count(self, owner: str) -> int:
        row = self.conn.execute("SELECT COUNT(*) FROM objects WHERE owner=?", (owner,)).fetchone()
        return int(row[0])

    def total_bytes(self) -> int:
        a = self.conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM objects").fetchone()[0]
        b = self.conn.execute("SELECT COALESCE(SUM(LENGTH(request) + COALESCE(LENGTH(result), 0)),"
                              " 0) FROM lines").fetchone()[0]
        c = self.conn.execute("SELECT COALESCE(SUM(LENGTH(data)), 0) FROM items").fetchone()[0]
        return int(a) + int(b) + int(c)

    # --- a batch's lines -----------------------------------------------------------------

    def add_lines(self, o: Obj, rows: list[tuple[int, str, str, str | None, str | None]]) -> None:
        """The batch and its lines, in one transaction: (idx, custom_id, state, request,
        result) each."""
        with self.conn:
            self.put(o)
            self.conn.executemany("INSERT INTO lines(batch_id, idx, custom_id, state, request, "
                                  "result) VALUES (?,?,?,?,?,?)",
                                  [(o.id, *r) for r in rows])

    def set_lines(self, o: Obj, rows: Iterable[tuple[int, str, str, str | None, str | None]]
                  ) -> None:
        """A batch's lines replaced by `rows` (validated anew after a restart), and the batch
        saved, in one transaction."""
        with self.conn:
            self.conn.execute("DELETE FROM lines WHERE batch_id=?", (o.id,))
            self.conn.executemany("INSERT INTO lines(batch_id, idx, custom_id, state, request, "
                                  "result) VALUES (?,?,?,?,?,?)", ((o.id, *r) for r in rows))
            self.save(o)

    def pending(self, batch_id: str, after: int = -1,
                limit: int = 1000) -> list[tuple[int, str, str]]:
        return self.conn.execute("SELECT idx, custom_id, request FROM lines WHERE batch_id=? "
                                 "AND state='pending' AND idx>? ORDER BY idx LIMIT ?",
                                 (batch_id, after, limit)).fetchall()

    def line_done(self, batch: Obj, idx: int, state: str, result: str) -> None:
        """One line's result and the batch's counts, in one transaction."""
        with self.conn:
            cur = self.conn.execute("UPDATE lines SET state=?, result=?, request=NULL WHERE "
                                    "batch_id=? AND idx=? AND state='pending'",
                                    (state, result, batch.id, idx))
            if cur.rowcount:
                self.save(batch)

    def results(self, batch_id: str, after: int = -1,
                limit: int = 1000) -> list[tuple[int, str, str, str | None]]:
        return self.conn.execute("SELECT idx, custom_id, state, result FROM lines WHERE "
                                 "batch_id=? AND idx>? ORDER BY idx LIMIT ?",
                                 (batch_id, after, limit)).fetchall()

    def line_states(self, batch_id: str) -> dict[str, int]:
        rows = self.conn.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id=? GROUP BY "
                                 "state", (batch_id,)).fetchall()
        return {r[0]: int(r[1]) for r in rows}

    def cancel_pending(self, batch: Obj, state: str, result: str) -> int:
        with self.conn:
            cur = self.conn.execute("UPDATE lines SET state=?, result=?, request=NULL WHERE "
                                    "batch_id=? AND state='pending'", (state, result, batch.id))
            self.save(batch)
        return int(cur.rowcount)

    # --- items under a parent ------------------------------------------------------------

    def add_items(self, parent: str, items: list[tuple[str, dict[str, Any]]],
                  then: Obj | None = None) -> None:
        with self.conn:
            self._add_items(parent, items, then)

    def _add_items(self, parent: str, items: list[tuple[str, dict[str, Any]]],
                   then: Obj | None = None) -> None:
        row = self.conn.execute("SELECT COALESCE(MAX(seq), -1) FROM items WHERE parent=?",
                                (parent,)).fetchone()
        seq = int(row[0]) + 1
        self.conn.executemany("INSERT INTO items(parent, seq, id, data) VALUES (?,?,?,?)",
                              [(parent, seq + i, iid, msgspec.json.encode(d).decode())
                               for i, (iid, d) in enumerate(items)])
        if then is not None:
            self.save(then)

    def items(self, parent: str, after: str | None, limit: int,
              newest_first: bool) -> tuple[list[dict[str, Any]], bool]:
        cmp, order = ("<", "DESC") if newest_first else (">", "ASC")
        where, args = "", []
        if after:
            row = self.conn.execute("SELECT seq FROM items WHERE parent=? AND id=?",
                                    (parent, after)).fetchone()
            if row:
                where, args = f" AND seq {cmp} ?", [row[0]]
        rows = self.conn.execute(f"SELECT data FROM items WHERE parent=?{where} ORDER BY seq "
                                 f"{order} LIMIT ?", (parent, *args, limit + 1)).fetchall()
        return [msgspec.json.decode(r[0]) for r in rows[:limit]], len(rows) > limit

    def item(self, parent: str, iid: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT data FROM items WHERE parent=? AND id=?",
                                (parent, iid)).fetchone()
        return msgspec.json.decode(row[0]) if row else None

    def delete_item(self, parent: str, iid: str) -> bool:
        cur = self.conn.execute("DELETE FROM items WHERE parent=? AND id=?", (parent, iid))
        return bool(cur.rowcount)
