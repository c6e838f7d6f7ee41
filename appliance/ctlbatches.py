"""`appliance ctl batches [list | show ID | cancel ID]`: the hub's batches, with the admin key.

Theory of operation: the admin key reads every key's batches through the client routes
(`/v1/batches` and `/v1/messages/batches`; hub/api/objects.py): `list` merges both kinds,
newest first, in a table (or the hub's JSON with `--json`); `show` prints one batch; an id
starting `msgbatch_` is Anthropic's, any other OpenAI's. Exit codes as `ctl`'s own.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, TextIO

import httpx

# The most batches `list` shows of each kind (one page of the hub's lists).
LIST_LIMIT = 100


def _path(bid: str) -> str:
    q = urllib.parse.quote(bid, safe="")
    return f"/v1/messages/batches/{q}" if bid.startswith("msgbatch_") else f"/v1/batches/{q}"


def _row(b: dict[str, Any]) -> dict[str, Any]:
    """One batch of either API as the table shows it."""
    if b.get("type") == "message_batch":
        c = b.get("request_counts") or {}
        done = c.get("succeeded", 0) + c.get("errored", 0) + c.get("canceled", 0) + c.get(
            "expired", 0)
        return {"id": b["id"], "status": b.get("processing_status"), "endpoint": "/v1/messages",
                "done": done, "total": done + c.get("processing", 0),
                "failed": c.get("errored", 0), "created": str(b.get("created_at") or "")}
    c = b.get("request_counts") or {}
    return {"id": b["id"], "status": b.get("status"), "endpoint": b.get("endpoint"),
            "done": c.get("completed", 0) + c.get("failed", 0), "total": c.get("total", 0),
            "failed": c.get("failed", 0), "created": str(b.get("created_at") or "")}


def table(batches: list[dict[str, Any]]) -> str:
    if not batches:
        return "no batches"
    rows = [["BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED"]]
    for b in map(_row, batches):
        pct = f" ({100 * b['done'] // b['total']}%)" if b["total"] else ""
        rows.append([b["id"], str(b["status"]), str(b["endpoint"]),
                     f"{b['done']}/{b['total']}{pct}", str(b["failed"])])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def run(action: str, bid: str | None, as_json: bool, client: httpx.Client, out: TextIO,
        err: TextIO) -> int:
    if action in ("show", "cancel") and not bid:
        print(f"appliance ctl batches {action}: give the batch id", file=err)
        return 2
    if action == "list":
        resps = [client.get(p, params={"limit": str(LIST_LIMIT)})
                 for p in ("/v1/batches", "/v1/messages/batches")]
    elif action == "show":
        resps = [client.get(_path(bid or ""))]
    else:
        resps = [client.post(_path(bid or "") + "/cancel")]
    for r in resps:
        if r.status_code != 200:
            try:
                msg = r.json().get("error", {}).get("message")
            except (ValueError, AttributeError):
                msg = r.text[:300]
            print(f"appliance ctl batches {action}: the hub answered {r.status_code}: {msg}",
                  file=err)
            return 1
    if action == "list":
        found = [b for r in resps for b in r.json().get("data", [])]
        found.sort(key=lambda b: str(b.get("created_at")), reverse=True)
        print(json.dumps(found, indent=2) if as_json else table(found), file=out)
    else:
        body = resps[0].json()
        print(json.dumps(body, indent=2) if as_json else table([body]), file=out)
    return 0
