"""A finished OpenAI batch's output and error files, written from its committed results.

Theory of operation: the results are read from the store in input order, a chunk at a
time, and written as JSONL (`lines.openai_line`, one line per `custom_id`): a 200 answer
to the output file, anything else (a refusal, a bad line, a line cancelled or expired) to
the error file. Each file is written beside the store under a temporary name, synced and
renamed, then becomes a file object (purpose `batch_output`) of the batch's owner, kept
until deleted or for the batch's `output_expires_after`. A file already made (a finalizing
batch resumed) is not made again.
"""

from __future__ import annotations

import os
import secrets
import time

import msgspec

from appliance.hub.store import ids, lines
from appliance.hub.store.db import Obj
from appliance.hub.store.store import Store

CHUNK = 1000


async def write_outputs(store: Store, b: Obj, hub_name: str) -> None:
    if b.data.get("output_file_id") or b.data.get("error_file_id"):
        return
    tmp_out = os.path.join(store.dir, f".out-{secrets.token_hex(8)}")
    tmp_err = os.path.join(store.dir, f".err-{secrets.token_hex(8)}")

    def write() -> tuple[int, int]:
        sizes = [0, 0]
        with open(tmp_out, "wb") as out, open(tmp_err, "wb") as err:
            after = -1
            while True:
                rows = store.db.results(b.id, after, CHUNK)
                if not rows:
                    break
                for idx, cid, _state, raw in rows:
                    after = idx
                    if raw is None:
                        continue
                    res = msgspec.json.decode(raw)
                    data = lines.encode_line(lines.openai_line(cid, res))
                    i = 0 if lines.succeeded(res) else 1
                    (out if i == 0 else err).write(data)
                    sizes[i] += len(data)
            for f in (out, err):
                f.flush()
                os.fsync(f.fileno())
        return sizes[0], sizes[1]

    try:
        out_size, err_size = await store.run(write)
        now = int(time.time())
        for tmp, size, field, name in ((tmp_out, out_size, "output_file_id", "output"),
                                       (tmp_err, err_size, "error_file_id", "error")):
            if not size:
                continue
            oid = ids.new("file-", hub_name)
            await store.run(os.replace, tmp, store.file_path(oid))
            keep = b.data.get("output_expires_seconds")
            expires = now + keep if isinstance(keep, int) else None
            o = Obj(oid, "file", b.owner, now, expires, size, "batch_output",
                    {"id": oid, "object": "file", "bytes": size, "created_at": now,
                     "filename": f"{b.id}_{name}.jsonl", "purpose": "batch_output",
                     "status": "processed", "expires_at": expires, "status_details": None})
            await store.run(store.db.put, o)
            store.charge(size)
            b.data[field] = oid
    finally:
        for tmp in (tmp_out, tmp_err):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
