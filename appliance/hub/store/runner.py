"""Running batches: each line through the hub's own router, as background work, durably.

Theory of operation: `Batches.run` (started in the hub's nursery) resumes every batch the
store holds unfinished, then runs each new one as it is created. A batch task validates
its input (OpenAI's: the input file, line by line, `lines.check_lines`), then runs its
pending lines, at most `Batch__MaxConcurrent` lines in flight per hub over all batches
(one `CapacityLimiter`). A line is one call of the router's `handle_inference` with the
batch owner's key and `x-priority: background`: the same auth, model rules, limits,
admission, retry and audit line as any request (the audit line carries `batch`). Its
answer is kept whole (bounded) and committed with the batch's counts in one transaction
-- a line is `pending` until then, so after a restart or kill -9 only lines without a
committed result run again (at most the ones that were in flight). A line the fleet has
no room for now (WAITS) waits and is tried again within its batch's window; one a node
failed (other 502/503/504) is tried a few times before it is the line's result. Cancel
stops new lines, lets those in flight end, marks the rest cancelled; past its window a
batch expires the same way. Then `finalizing`: OpenAI batches get their output and error
files (JSONL, one line per `custom_id`), Anthropic's are read from the lines directly.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from appliance.config import Config
from appliance.http.asgi import Receive, Scope, Send, never, replay
from appliance.http.errors import api_of, error_body
from appliance.hub.api.request import BATCH_SCOPE
from appliance.hub.store import lines
from appliance.hub.store.beside import Beside
from appliance.hub.store.db import Obj
from appliance.hub.store.outputs import write_outputs
from appliance.hub.store.store import Store, disk_full

# The router's `handle_inference` for this hub: (scope, receive, send, api).
Serve = Callable[[Scope, Receive, Send, str], Awaitable[None]]
log = logging.getLogger("appliance.hub.batches")

# One line's whole answer: a long completion with logprobs is a few MiB.
MAX_ANSWER_BYTES = 64 * 1024 * 1024
# A line a node failed (502/503/504 other than WAITS) is tried this many times in all,
# waiting RETRY_SECONDS * attempt between: the fleet's nodes come back within a minute.
ATTEMPTS = 4
RETRY_SECONDS = 5.0
# Refusals that mean "the fleet has no room for background work now": a line waits and is
# tried again until its batch's window ends (a batch is there to fill idle places).
WAITS = ("priority_wait_timeout", "queue_full", "queue_timeout", "no_capacity",
         "model_loading", "preempted", "busy", "rate_limit_exceeded", "overloaded_error")
# Pending lines read from the store at a time.
CHUNK = 500
# OpenAI's completion window: only 24h exists.
WINDOW_SECONDS = 24 * 3600


RUNNING = ("validating", "in_progress", "finalizing", "cancelling")


def _decoded(body: bytes) -> tuple[Any, bool]:
    """The answer's JSON, and whether it was whole JSON (else its text)."""
    try:
        return (msgspec.json.decode(body) if body else None), bool(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace"), False


def _code(body: bytes) -> str:
    """The error code of a refusal's body (OpenAI's shape), or ""."""
    try:
        err = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        return ""
    # Anthropic's shape has a type where OpenAI's has a code (503: overloaded_error)
    return str(err.get("code") or err.get("type") or "") if isinstance(err, dict) else ""


def snapshot(o: Obj) -> Obj:
    """A copy the store's thread may encode while this loop goes on changing the original."""
    return Obj(o.id, o.kind, o.owner, o.created_at, o.expires_at, o.bytes, o.state,
               msgspec.json.decode(msgspec.json.encode(o.data)))


def set_state(o: Obj, state: str) -> None:
    o.state = state
    o.data["status"] = state
    o.data[f"{state}_at"] = int(time.time())


class Batches:
    def __init__(self, cfg: Callable[[], Config], store: Store, serve: Serve,
                 beside: Beside | None = None) -> None:
        """`cfg`: the configuration as the last reload left it (the owner's key is read
        from it at each line). `beside`: how many lines go while other work is about
        (beside.py; shared with background responses)."""
        self.cfg = cfg
        self.beside = beside or Beside(None)
        self.serve = serve
        self.store = store
        self.limiter = trio.CapacityLimiter(cfg().batch.max_concurrent)
        self.cancels: dict[str, trio.Event] = {}
        self.live: dict[str, Obj] = {}  # the batches running now, as their tasks see them
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            waiting = []
            for kind in ("batch", "msgbatch"):
                waiting += await self.store.run(self.store.db.in_state, kind, RUNNING)
            for b in waiting:
                log.info("resuming batch %s (%s)", b.id, b.state)
                self.start(b)
            task_status.started()
            await trio.sleep_forever()

    def start(self, b: Obj) -> None:
        assert self._nursery is not None
        self.cancels[b.id] = trio.Event()
        self.live[b.id] = b
        if b.state == "cancelling":
            self.cancels[b.id].set()
        self._nursery.start_soon(self._batch, b)

    def progress(self) -> list[dict[str, Any]]:
        """The running batches as /api/status shows them (oldest first)."""
        out = []
        for b in sorted(self.live.values(), key=lambda x: x.created_at):
            counts = b.data.get("request_counts") or {}
            out.append({"id": b.id, "api": "openai" if b.kind == "batch" else "anthropic",
                        "owner": b.owner, "status": b.state, "endpoint": b.data.get("endpoint"),
                        "total": counts.get("total", 0), "completed": counts.get("completed", 0),
                        "failed": counts.get("failed", 0), "created_at": b.created_at})
        return out

    def cancel(self, b: Obj) -> Obj:
        """Ask a running batch to stop; the object as it is now."""
        live = self.live.get(b.id)
        if live is None:
            return b
        if live.state in ("validating", "in_progress"):
            set_state(live, "cancelling")
        self.cancels[b.id].set()
        return live

    async def _batch(self, b: Obj) -> None:
        try:
            if b.state == "validating":
                await self._validate(b)
            ending = None
            if b.state in ("in_progress", "cancelling"):
                ending = await self._lines(b)
            await self._finish(b, ending)
        except (OSError, msgspec.MsgspecError) as e:  # the disk under the store failed
            log.error("batch %s stopped: %s", b.id, e)
            b.data["errors"] = {"object": "list", "data": [
                {"code": "store_full" if isinstance(e, OSError) and disk_full(e)
                 else "store_error", "message": str(e)[:500], "line": None, "param": None}]}
            set_state(b, "failed")
            with trio.move_on_after(10, shield=True):
                await self.store.run(self.store.db.save, snapshot(b))
        finally:
            self.live.pop(b.id, None)
            self.cancels.pop(b.id, None)

    async def _validate(self, b: Obj) -> None:
        path = self.store.file_path(b.data["input_file_id"])
        endpoint = b.data["endpoint"]
        most = self.cfg().batch.max_lines
        problem = ""

        def check() -> None:
            nonlocal problem
            try:
                with open(path, "rb") as f:
                    rows = list(lines.check_lines(f, endpoint, most))
            except FileNotFoundError:
                problem = "the input file is gone"
                return
            except ValueError as e:
                problem = str(e)
                return
            n = len(rows)
            failed = sum(1 for r in rows if r[2] == "failed")
            b2 = snapshot(b)
            b2.data["request_counts"] = {"total": n, "completed": 0, "failed": failed}
            b2.data["in_progress_at"] = int(time.time())
            if b.state == "validating":  # (cancelled meanwhile: it stays cancelling)
                b2.state = b2.data["status"] = "in_progress"
            self.store.db.set_lines(b2, rows)
            b.data, b.state = b2.data, b2.state

        await self.store.run(check)
        if problem:
            b.data["errors"] = {"object": "list", "data": [
                {"code": "invalid_file", "message": problem, "line": None, "param": None}]}
            set_state(b, "failed")
            await self.store.run(self.store.db.save, snapshot(b))
            return
        failed = b.data["request_counts"]["failed"]
        if failed:
            self.store.metrics.lines.labels("failed").inc(failed)

    async def _lines(self, b: Obj) -> str:
        """Run the pending lines; how the batch ends: completed, cancelled or expired."""
        stop = self.cancels[b.id]
        after = -1  # lines are taken in order; one running is still pending in the store
        async with trio.open_nursery() as nursery:
            while not stop.is_set():
                pending = await self.store.run(self.store.db.pending, b.id, after, CHUNK)
                if not pending:
                    break
                for idx, _cid, request in pending:
                    token = object()
                    await self.limiter.acquire_on_behalf_of(token)
                    bc = self.cfg().batch
                    await self.beside.room(bc.max_concurrent, bc.beside_percent)
                    if stop.is_set() or self._expired(b):
                        self.limiter.release_on_behalf_of(token)
                        break
                    self.beside.started()
                    nursery.start_soon(self._line, b, idx, request, token)
                    after = idx
                else:
                    continue
                break
            expired = self._expired(b) and not stop.is_set()
            if expired:  # lines waiting for room stop waiting
                stop.set()
        # What was not run is cancelled (or expired) now; in-flight ones finished above.
        ending = "expired" if expired else "cancelled" if stop.is_set() else "completed"
        if (await self.store.run(self.store.db.line_states, b.id)).get("pending"):
            state = "expired" if expired else "cancelled"
            code = "batch_expired" if state == "expired" else "batch_cancelled"
            res = lines.error_result(code, f"the batch was {state} before this line ran")
            n = await self.store.run(self.store.db.cancel_pending, snapshot(b), state, res)
            self.store.metrics.lines.labels(state).inc(n)
        return ending

    def _expired(self, b: Obj) -> bool:
        window = b.data.get("expires_at")
        return isinstance(window, int) and time.time() >= window

    async def _line(self, b: Obj, idx: int, request: str, token: object) -> None:
        """One line, its place held until its result is committed: at most
        Batch__MaxConcurrent lines are ever run but not yet recorded (what a kill -9 may
        make run twice)."""
        try:
            res, ok = await self._attempts(b, request)
            counts = b.data["request_counts"]
            key = "completed" if ok else "failed"
            counts[key] = counts.get(key, 0) + 1
            with trio.CancelScope(shield=True):  # a result the fleet paid for is kept
                await self.store.run(self.store.db.line_done, snapshot(b), idx, key, res)
            self.store.metrics.lines.labels(key).inc()
        finally:
            self.beside.ended()
            self.limiter.release_on_behalf_of(token)

    async def _attempts(self, b: Obj, request: str) -> tuple[str, bool]:
        url = b.data["endpoint"]
        cfg = self.cfg()
        # The request id the audit line and the output line share: 32 hex digits, as the
        # hub makes its own (llama-cpp-python's server refuses an x-request-id that is no
        # UUID with a 400).
        rid = secrets.token_hex(16)
        status, body = 0, b""
        attempt, stop = 0, self.cancels[b.id]
        decoded: Any = None
        while True:
            status, body, final = await run_line(self.serve, cfg, b.owner, url,
                                                 request.encode(), b.id, rid)
            decoded, whole = _decoded(body)
            if status == 200 and not whole:  # cut mid-answer (its node lost): not an answer
                status, final = 502, False
                decoded = {"error": {"code": "node_lost", "message": "the answer was cut"}}
            if status not in (429, 502, 503, 504) or final or stop.is_set() or self._expired(b):
                break
            if _code(body) not in WAITS:  # a node failed: a few more tries
                attempt += 1
                if attempt >= ATTEMPTS:
                    break
            # no room for background work now: a batch waits for idle places, its window long
            await trio.sleep(RETRY_SECONDS * max(1, attempt))
        if status == 0:
            return lines.error_result("internal_error", "the hub gave no answer"), False
        return lines.result(status, decoded, rid), status == 200

    async def _finish(self, b: Obj, ending: str | None) -> None:
        """Files (OpenAI's) first, then the final status: a client that reads it finds
        them."""
        if b.state == "failed":  # its input could not be read
            await self.store.run(self.store.db.save, snapshot(b))
            return
        final = ending or ("cancelled" if b.state == "cancelling" else "completed")
        if final == "completed":
            set_state(b, "finalizing")
            await self.store.run(self.store.db.save, snapshot(b))
        if b.kind == "batch":
            await self._files(b)
        else:
            b.data["ended_at"] = int(time.time())
        set_state(b, final)
        await self.store.run(self.store.db.save, snapshot(b))
        log.info("batch %s %s: %s", b.id, final, b.data.get("request_counts"))

    async def _files(self, b: Obj) -> None:
        """The output and error files, from the committed results, in input order."""
        await write_outputs(self.store, b, self.cfg().hub_name())


async def run_line(serve: Serve, cfg: Config, owner: str, url: str, body: bytes,
                   batch_id: str, rid: str) -> tuple[int, bytes, bool]:
    """One request through the router as the owner's background work: (status, body,
    whether the hub said a retry cannot cure it: `x-should-retry: false`)."""
    headers = [(b"content-type", b"application/json"), (b"x-priority", b"background"),
               (b"x-request-id", rid.encode())]
    key = next((c.key for c in cfg.auth.clients if c.name == owner), None)
    if key is None and owner != "anonymous":
        return 401, error_body(api_of(url), 401, "invalid_api_key",
                               f"the key of this batch's owner {owner!r} is no longer "
                               "configured"), True
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": url, "headers": headers,
                             "query_string": b"", "extensions": {}, "client": ("batch", 0),
                             BATCH_SCOPE: batch_id}
    status, final = 0, False
    parts: list[bytes] = []
    size = 0

    async def send(msg: dict[str, Any]) -> None:
        nonlocal status, size, final
        if msg["type"] == "http.response.start":
            status = msg["status"]
            final = (b"x-should-retry", b"false") in msg.get("headers", [])
        elif msg["type"] == "http.response.body":
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise trio.BrokenResourceError("a batch line's answer is over its bound")
            parts.append(chunk)

    await serve(scope, replay(body, never), send, api_of(url))
    return status, b"".join(parts), final
