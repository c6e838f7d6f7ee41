"""Where each API names a request's output cap, and writing one into a request's body.

The hub writes a cap into a request that names none (or Ollama's negative `num_predict`,
"until the model stops") when its key's token limits need one (decide/limits.py
`Limiter.uncapped`): OpenAI's chat and completions `max_tokens`, the Responses API's
`max_output_tokens`, Ollama's `options.num_predict`. Anthropic's Messages always name
`max_tokens`; embeddings and token counts have no output, and get nothing written.
Pure: it never reads the limits, it only writes what it is given.
"""

from __future__ import annotations

from typing import Any

import msgspec

_enc = msgspec.json.Encoder()
# The most bytes writing a cap adds to a body: `,"options":{"num_predict":16777216}` is 36
# (MAX_OUTPUT_CAP has 8 digits). The cap is computed against the body plus this, so the
# body it goes out in still fits the key's limit.
ROOM = 40
# Path -> the field (a dotted path into the body) its API reads the output cap from.
CAP_FIELD = {
    "/v1/chat/completions": "max_tokens",
    "/v1/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/v1/messages": "max_tokens",
    "/api/chat": "options.num_predict",
    "/api/generate": "options.num_predict",
}


def with_cap(path: str, obj: dict[str, Any], cap: int) -> tuple[dict[str, Any], bytes] | None:
    """`obj` with its output cap set to `cap`, and its bytes; None where the path has no
    output (or its `options` is not an object: the API's checks answer that)."""
    field = CAP_FIELD.get(path)
    if field is None:
        return None
    out = dict(obj)
    if field == "options.num_predict":
        opts = out.get("options")
        if opts is not None and not isinstance(opts, dict):
            return None
        out["options"] = {**(opts or {}), "num_predict": cap}
    else:
        out[field] = cap
    return out, _enc.encode(out)
