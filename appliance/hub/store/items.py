"""Responses items as the store keeps them: every item has an id and a type. No I/O.

Theory of operation: a Responses `input` is a string (one user message) or a list of
items; a conversation's items are the same kinds. `normalize` makes each an item as
OpenAI lists it (`input_items`, conversation items): a `message` with `content` parts
(`input_text` for what the user, system or developer said, `output_text` for the
assistant), `function_call`, `function_call_output` -- each with an id (`msg_`, `fc_`,
`fco_`, `item_`) when it came without one. The translator (translate/responses.py) reads
these items back as they are, so a chain or a conversation is rebuilt by concatenation.
"""

from __future__ import annotations

import secrets
from typing import Any

from appliance.http.errors import ApiError

# Items one request may add to a conversation (OpenAI's bound is 20 on create and add).
MAX_ADD = 20
# Items a rebuilt input may hold: a long agent run is a few hundred.
MAX_HISTORY = 10_000
_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def _id(kind: str) -> str:
    return f"{_PREFIX.get(kind, 'item_')}{secrets.token_hex(16)}"


def normalize(x: Any, where: str = "input") -> list[dict[str, Any]]:
    if isinstance(x, str):
        return [{"type": "message", "id": _id("message"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": x}]}]
    if not isinstance(x, list):
        raise ApiError(400, "invalid_request", f"'{where}' must be a string or an array of items",
                       param=where)
    out = []
    for i, it in enumerate(x):
        if not isinstance(it, dict):
            raise ApiError(400, "invalid_request", f"'{where}[{i}]' must be an object",
                           param=f"{where}[{i}]")
        item = dict(it)
        kind = item.setdefault("type", "message")
        if not isinstance(kind, str):
            raise ApiError(400, "invalid_request", f"'{where}[{i}].type' must be a string",
                           param=f"{where}[{i}].type")
        if not isinstance(item.get("id"), str) or not item["id"]:
            item["id"] = _id(kind)
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        out.append(item)
    return out


def output_items(response: dict[str, Any]) -> list[dict[str, Any]]:
    out = response.get("output")
    return [o for o in out if isinstance(o, dict)] if isinstance(out, list) else []
