"""OpenAI's Files API on the hub's store: upload, list, retrieve, content, delete.

Theory of operation: an upload (`POST /v1/files`, multipart/form-data: `purpose`, `file`,
optionally `expires_after[anchor]` / `expires_after[seconds]`) is streamed to a temporary
file beside the store as it arrives -- never held whole: each chunk written is given back
to the listener's body budget. The server bounds the declared length (Store__MaxFileMb,
hub.py's limits); a chunked body is counted here and refused 413 `body_too_large` at the
bound, its partial file removed. A disk that fills, or a store past Store__MaxTotalMb, is
507 `store_full`: the temporary file goes, every earlier object stays. The file becomes
visible only once whole (renamed into place, then its row committed). Content is read
back in chunks from disk, never whole.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import TYPE_CHECKING, Any

import trio

from appliance.bounds import echo
from appliance.http.asgi import Receive, Scope, Send, header, release, send_json
from appliance.http.errors import ApiError
from appliance.http.multipart import Done, MultipartError, Part, PartEnd, Reader, boundary_of
from appliance.hub.api import peerlists
from appliance.hub.api.objects import Caller, find, listing, maker, page_ask, store_of
from appliance.hub.store import ids
from appliance.hub.store.db import Obj
from appliance.hub.store.store import disk_full

if TYPE_CHECKING:
    from appliance.hub.hub import Hub
    from appliance.hub.store.store import Store

PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
# A form field other than the file is a word or a number.
FIELD_MAX = 1024
# Files are read back in chunks of this size (a relay's usual buffer).
READ_CHUNK = 256 * 1024
# A refused upload's rest is read and dropped up to this much, for this long, so its client
# reads the answer (past it the connection just ends): a few seconds of a LAN upload.
DRAIN_MAX = 256 * 1024 * 1024
DRAIN_SECONDS = 10.0
# OpenAI's expires_after bounds: an hour to 30 days.
EXPIRES_MIN, EXPIRES_MAX = 3600, 30 * 86400


def file_object(o: Obj) -> dict[str, Any]:
    return dict(o.data)


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send, c: Caller,
                 rest: list[str]) -> None:
    store = store_of(hub)
    method = scope["method"]
    if not rest:
        if method == "POST":
            o = await upload(hub, store, scope, receive, maker(c))
            await send_json(send, 200, file_object(o))
        elif method == "GET":
            ask = page_ask(scope)
            extra, args = ("", ()) if "purpose" not in ask.query else (" AND state=?",
                                                                          (ask.query["purpose"],))
            at = await peerlists.cursor_at(hub, scope, ask, store, "file", "file-", c.owner)
            objs, more = await store.run(store.db.page, "file", c.owner, ask.after, ask.limit,
                                         ask.newest_first, extra, args, at)
            data, more = await peerlists.merged(hub, scope, ask, at,
                                                [file_object(o) for o in objs], more)
            await send_json(send, 200, listing(data, more))
        else:
            raise ApiError(405, "method_not_allowed", "/v1/files takes GET or POST")
        return
    o = await find(hub, store, c, "file", "file-", rest[0])
    if len(rest) == 1 and method == "GET":
        await send_json(send, 200, file_object(o))
    elif len(rest) == 1 and method == "DELETE":
        await store.remove(o)
        await send_json(send, 200, {"id": o.id, "object": "file", "deleted": True})
    elif len(rest) == 2 and rest[1] == "content" and method == "GET":
        await send_file(store, o, send)
    else:
        raise ApiError(404, "not_found", f"no route {method} /v1/files/{echo('/'.join(rest))}")


async def send_file(store: Store, o: Obj, send: Send) -> None:
    path = store.file_path(o.id)
    try:
        f = await trio.open_file(path, "rb")
    except FileNotFoundError:
        raise ApiError(404, "not_found", f"the content of {o.id} is gone") from None
    async with f:
        size = os.fstat(f.fileno()).st_size
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"content-length", str(size).encode())]})
        left = size
        while left > 0:
            chunk = await f.read(min(READ_CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
        if left:  # the file shrank under us: the connection ends short, never padded
            raise trio.BrokenResourceError("file changed while sent")
    if size == 0:
        await send({"type": "http.response.body", "body": b""})


class _Upload:
    """One upload in progress: the form's fields and the file being written."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.fields: dict[str, str] = {}
        self.filename = ""
        self.size = 0
        self.tmp = os.path.join(store.dir, f".upload-{secrets.token_hex(8)}")
        self.file: trio.abc.AsyncResource | None = None
        self._f: Any = None
        self.current: str | None = None
        self.value = b""

    async def event(self, e: object) -> None:
        if isinstance(e, Part):
            self.current = e.name
            if e.name == "file":
                if self._f is not None:
                    raise ApiError(400, "invalid_request", "more than one file in the upload")
                self.filename = (e.filename or "upload")[:255]
                self._f = await trio.open_file(self.tmp, "xb")
            self.value = b""
        elif isinstance(e, bytes):
            if self.current == "file":
                await self.write(e)
            else:
                self.value += e
                if len(self.value) > FIELD_MAX:
                    raise ApiError(400, "invalid_request",
                                   f"form field {echo(self.current or '')!r} is too long")
        elif isinstance(e, PartEnd):
            if self.current != "file" and self.current is not None:
                self.fields[self.current] = self.value.decode("utf-8", "replace")
            self.current = None

    async def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.store.max_file:
            raise ApiError(413, "body_too_large", f"the file is over Store__MaxFileMb="
                           f"{self.store.cfg.max_file_mb}")
        self.store.room(self.size)
        try:
            await self._f.write(data)
        except OSError as e:
            if disk_full(e):
                raise ApiError(507, "store_full", "the disk under the store is full; "
                               "nothing was kept of this upload") from None
            raise

    async def finish(self, dest: str) -> None:
        try:
            await self._f.flush()
            await trio.to_thread.run_sync(os.fsync, self._f.fileno())
        except OSError as e:
            if disk_full(e):
                raise ApiError(507, "store_full", "the disk under the store is full; "
                               "nothing was kept of this upload") from None
            raise
        await self._f.aclose()
        self._f = None
        await trio.to_thread.run_sync(os.replace, self.tmp, dest)

    async def discard(self) -> None:
        with trio.move_on_after(5, shield=True):
            if self._f is not None:
                await self._f.aclose()
            try:
                await trio.to_thread.run_sync(os.unlink, self.tmp)
            except FileNotFoundError:
                pass


async def upload(hub: Hub, store: Store, scope: Scope, receive: Receive, owner: str) -> Obj:
    boundary = boundary_of(header(scope, b"content-type") or "")
    if boundary is None:
        raise ApiError(400, "invalid_request", "an upload is multipart/form-data with a "
                       "boundary (fields purpose and file)")
    await store.check_quota(owner)
    reader, up, done, more = Reader(boundary), _Upload(store), False, True
    try:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise trio.BrokenResourceError("client went away during the upload")
            chunk = msg.get("body", b"")
            try:
                events = reader.feed(chunk)
            except MultipartError as e:
                raise ApiError(400, "invalid_request", f"bad multipart body: {e}") from None
            for ev in events:
                if isinstance(ev, Done):
                    done = True
                await up.event(ev)
            release(scope, len(chunk))  # on disk now (or about to be refused): not held
            more = bool(msg.get("more_body"))
            if not more:
                break
        if not done or up._f is None:
            raise ApiError(400, "invalid_request", "the upload has no file part" if done
                           else "the multipart body ended before its closing boundary")
        purpose = up.fields.get("purpose", "")
        if purpose not in PURPOSES:
            raise ApiError(400, "invalid_request", f"purpose must be one of {', '.join(PURPOSES)}",
                           param="purpose")
        now = int(time.time())
        expires = _expires(up.fields, now)
        oid = ids.new("file-", hub.cfg.hub_name())
        store.room(up.size)
        await up.finish(store.file_path(oid))
    except ApiError:
        await up.discard()
        if more:
            await _drain(scope, receive)
        raise
    except BaseException:
        await up.discard()
        raise
    o = Obj(oid, "file", owner, now, expires, up.size, purpose,
            {"id": oid, "object": "file", "bytes": up.size, "created_at": now,
             "filename": up.filename, "purpose": purpose, "status": "processed",
             "expires_at": expires, "status_details": None})
    try:
        await store.put(o)
    except BaseException:
        with trio.move_on_after(5, shield=True):
            await store.remove(o)
        raise
    return o


async def _drain(scope: Scope, receive: Receive) -> None:
    """Read (and drop) what is left of a refused upload, bounded, so the client that is
    still sending it reads the refusal instead of a reset connection."""
    left = DRAIN_MAX
    with trio.move_on_after(DRAIN_SECONDS):
        while left > 0:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            chunk = msg.get("body", b"")
            left -= len(chunk)
            release(scope, len(chunk))
            if not msg.get("more_body"):
                return


def _expires(fields: dict[str, str], now: int) -> int | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at" or seconds is None or not seconds.isdigit() \
            or not EXPIRES_MIN <= int(seconds) <= EXPIRES_MAX:
        raise ApiError(400, "invalid_request", "expires_after is anchor created_at and seconds "
                       f"{EXPIRES_MIN}..{EXPIRES_MAX}", param="expires_after")
    return now + int(seconds)
