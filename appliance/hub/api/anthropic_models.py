"""`GET /v1/models` and `/v1/models/{id}` in Anthropic's shape, for Anthropic's clients.

Theory of operation: OpenAI and Anthropic share the path and not the answer. A request
that says it is Anthropic's -- an `anthropic-version` header (every Anthropic SDK sends
one) or its key in `x-api-key` -- gets Anthropic's list: `{"data": [...], "has_more",
"first_id", "last_id"}` with items `{"type": "model", "id", "display_name", "created_at"}`
(RFC 3339), paged by `limit` (1..1000, default 20), `after_id` and `before_id` as
Anthropic pages; anything else gets OpenAI's (status.openai_models). Pure functions over
the OpenAI list the caller already built: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qs

from appliance.http.errors import ApiError

# Anthropic's page size when `limit` is not given, and its largest.
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000


def is_anthropic(headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """Does the request come from an Anthropic client (its version header, or its key
    header with no OpenAI bearer)?"""
    names = {k for k, _ in headers}
    return b"anthropic-version" in names or (b"x-api-key" in names
                                             and b"authorization" not in names)


def anthropic_model(item: dict[str, Any]) -> dict[str, Any]:
    """One model of the OpenAI list (`id`, `created` in seconds) as Anthropic's."""
    created = item.get("created")
    when = time.gmtime(created if isinstance(created, (int, float)) else 0)
    return {"type": "model", "id": item["id"], "display_name": item["id"],
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", when)}


def _one(params: dict[str, list[str]], name: str) -> str | None:
    v = params.get(name)
    return v[-1] if v else None


def anthropic_models(items: list[dict[str, Any]], query: bytes) -> dict[str, Any]:
    """The OpenAI list's `items` as Anthropic's page for `query` (limit, after_id,
    before_id); ApiError 400 for a limit out of range."""
    params = parse_qs(query.decode("latin-1"), keep_blank_values=False)
    raw = _one(params, "limit")
    try:
        limit = int(raw) if raw is not None else DEFAULT_LIMIT
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(400, "invalid_request", f"limit must be an integer 1..{MAX_LIMIT}",
                       param="limit")
    models = [anthropic_model(i) for i in items]
    ids = [m["id"] for m in models]
    after, before = _one(params, "after_id"), _one(params, "before_id")
    if before is not None:
        end = ids.index(before) if before in ids else 0
        page = models[max(0, end - limit):end]
        more = end - limit > 0
    else:
        start = ids.index(after) + 1 if after is not None and after in ids else (
            len(ids) if after is not None else 0)
        page = models[start:start + limit]
        more = start + limit < len(models)
    return {"data": page, "has_more": more,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}
