"""A batch's lines: checking the input, and the output in each API's shape. No I/O.

Theory of operation: an OpenAI input file is JSONL, one request a line
(`{"custom_id", "method": "POST", "url", "body"}`), split on `\\n` only. `check_lines`
turns each line into a row: `pending` with the request the router will get (the body,
`stream` forced off), or `failed` at once with an error saying which line and why -- a
bad line never stops the batch. A `custom_id` seen before is an error line too, so each
`custom_id` appears once among the results. A finished line's result is kept in one
neutral form (`result`: status, body, request id, or an error code and message) and
rendered in OpenAI's batch output shape (`openai_line`) or Anthropic's results shape
(`anthropic_line`) when read.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

# Endpoints a batch line may name (as OpenAI's Batch API takes them).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Anthropic's custom_id rule (Message Batches API reference).
ANTHROPIC_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# What an error message may quote of a client's line.
QUOTE = 120

Row = tuple[int, str, str, "str | None", "str | None"]  # idx, custom_id, state, request, result

_enc = msgspec.json.Encoder()


def result(status: int, body: Any, request_id: str, error: dict[str, str] | None = None) -> str:
    return _enc.encode({"status": status, "body": body, "request_id": request_id,
                        "error": error, "id": f"batch_req_{secrets.token_hex(12)}"}).decode()


def error_result(code: str, message: str) -> str:
    return result(0, None, "", {"code": code, "message": message})


def _fail(idx: int, cid: str, code: str, message: str) -> Row:
    return (idx, cid, "failed", None, error_result(code, f"line {idx + 1}: {message}"))


def check_lines(lines: Iterable[bytes], endpoint: str, max_lines: int) -> Iterator[Row]:
    """One row per non-empty input line, in order; at most `max_lines` (Batch__MaxLines;
    then raises)."""
    seen: set[str] = set()
    idx = -1
    for raw in lines:
        if not raw.strip():
            continue
        idx += 1
        if idx >= max_lines:
            raise ValueError(f"the input has more than Batch__MaxLines={max_lines} lines")
        try:
            obj = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            yield _fail(idx, "", "invalid_json", "not valid JSON")
            continue
        if not isinstance(obj, dict):
            yield _fail(idx, "", "invalid_request", "not a JSON object")
            continue
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid or len(cid) > 512:
            yield _fail(idx, "", "invalid_request", "custom_id must be a non-empty string")
            continue
        if cid in seen:
            yield _fail(idx, cid, "duplicate_custom_id", f"custom_id {cid[:QUOTE]!r} appeared "
                        "on an earlier line")
            continue
        seen.add(cid)
        if obj.get("method", "POST") != "POST":
            yield _fail(idx, cid, "invalid_request", "method must be POST")
            continue
        if obj.get("url") != endpoint:
            yield _fail(idx, cid, "invalid_url", f"url must be the batch's endpoint {endpoint}")
            continue
        body = obj.get("body")
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            yield _fail(idx, cid, "invalid_request", "body must be an object with a model")
            continue
        yield (idx, cid, "pending", request_body(body), None)


def request_body(body: dict[str, Any]) -> str:
    """The request as the router gets it: never streamed (a batch keeps whole answers)."""
    body = dict(body)
    body.pop("stream", None)
    body.pop("stream_options", None)
    if "background" in body:
        body.pop("background")
    return _enc.encode(body).decode()


def split_lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


# --- rendering --------------------------------------------------------------------------


def openai_line(cid: str, res: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's output (and error) file line for one result."""
    if res.get("error") is not None:
        return {"id": res["id"], "custom_id": cid or None, "response": None,
                "error": res["error"]}
    return {"id": res["id"], "custom_id": cid,
            "response": {"status_code": res["status"], "request_id": res["request_id"],
                         "body": res["body"]}, "error": None}


def succeeded(res: dict[str, Any]) -> bool:
    return res.get("error") is None and res.get("status") == 200


def anthropic_line(cid: str, state: str, res: dict[str, Any] | None) -> dict[str, Any]:
    """Anthropic's results line for one request."""
    if state == "cancelled":
        return {"custom_id": cid, "result": {"type": "canceled"}}
    if state == "expired":
        return {"custom_id": cid, "result": {"type": "expired"}}
    if res is not None and succeeded(res):
        return {"custom_id": cid, "result": {"type": "succeeded", "message": res["body"]}}
    err: Any = None
    if res is not None and isinstance(res.get("body"), dict) and res["body"].get("type") == "error":
        err = res["body"]
    else:
        msg = (res or {}).get("error") or {"message": "the request failed"}
        err = {"type": "error", "error": {"type": "invalid_request_error" if (res or {}).get(
            "status", 0) < 500 else "api_error", "message": msg.get("message", "")}}
    return {"custom_id": cid, "result": {"type": "errored", "error": err}}


def encode_line(obj: dict[str, Any]) -> bytes:
    """One JSONL line; U+2028/U+2029 escaped so a reader splitting on Unicode line breaks
    does not cut it (STYLE 28)."""
    return (_enc.encode(obj).replace("\u2028".encode(), b"\\u2028")
            .replace("\u2029".encode(), b"\\u2029") + b"\n")
