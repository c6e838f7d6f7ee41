"""The sim's answers shaped as clients ask for them: JSON output, valid against a schema,
and log probabilities.

Theory of operation: clients test structured output first (`response_format` json_object /
json_schema, Ollama `format` "json" or a schema), so the sim answers those with JSON text
instead of words: for a schema, the smallest instance it can build (`instance`: an object
with its required properties, each of its type; the first of an enum or of anyOf/oneOf;
arrays of minItems items; local `$ref`s followed to a bounded depth), else an object of one
string. The text is cut into token-sized pieces, so streaming sends it as it sends words.
Log probabilities are deterministic numbers of each token, in each API's shape. Pure
functions; server.py sends what they build.
"""

from __future__ import annotations

import hashlib
from typing import Any

from appliance.http.lines import LineEncoder

_enc = LineEncoder()  # lines escaped: appliance/http/lines.py
# Schemas nest (a $ref to itself: a tree); past this depth a value is the type's simplest.
MAX_DEPTH = 16
# Characters of JSON text per streamed piece: about a token's worth of JSON.
PIECE_CHARS = 4
# Alternatives listed per token when top_logprobs asks (OpenAI caps it at 20).
MAX_TOP = 20
_SIMPLE: dict[str, Any] = {"string": "sim", "integer": 1, "number": 1.5, "boolean": True,
                           "null": None, "array": [], "object": {}}


def wanted_schema(response_format: Any, fmt: Any) -> tuple[bool, dict[str, Any] | None]:
    """(JSON asked for, its schema or None) from OpenAI's `response_format` or Ollama's
    `format` ("json", or a schema object)."""
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_schema":
            js = response_format.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            return True, schema if isinstance(schema, dict) else None
        if kind == "json_object":
            schema = response_format.get("schema")  # llama-cpp-python's spelling
            return True, schema if isinstance(schema, dict) else None
    if fmt == "json":
        return True, None
    if isinstance(fmt, dict):
        return True, fmt
    return False, None


def _resolve(ref: str, root: dict[str, Any]) -> Any:
    """A local `#/a/b` reference into `root`; None when it points nowhere."""
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def instance(schema: Any, root: dict[str, Any] | None = None, depth: int = 0) -> Any:
    """The smallest value valid against `schema` that this knows how to build."""
    if not isinstance(schema, dict):
        return {}
    root = schema if root is None else root
    if depth > MAX_DEPTH:
        return _SIMPLE.get(_type_of(schema), None)
    if isinstance(schema.get("$ref"), str):
        return instance(_resolve(schema["$ref"], root), root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    if "default" in schema:
        return schema["default"]
    for key in ("anyOf", "oneOf"):
        alts = schema.get(key)
        if isinstance(alts, list) and alts:
            non_null = [a for a in alts if not (isinstance(a, dict) and a.get("type") == "null")]
            return instance((non_null or alts)[0], root, depth + 1)
    if isinstance(schema.get("allOf"), list) and schema["allOf"]:
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            got = instance(part, root, depth + 1)
            if isinstance(got, dict):
                merged.update(got)
            else:
                return got
        return merged
    kind = _type_of(schema)
    if kind == "object":
        props: dict[str, Any] = schema.get("properties") or {}
        required: list[Any] = schema.get("required") or []
        if not isinstance(props, dict) or not isinstance(required, list):
            return {}
        return {k: instance(props.get(k, {}), root, depth + 1) for k in required
                if isinstance(k, str)}
    if kind == "array":
        n = schema.get("minItems")
        n = n if isinstance(n, int) and 0 <= n <= 64 else 0
        item = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        return [instance(item, root, depth + 1) for _ in range(n)]
    if kind == "string":
        n = schema.get("minLength")
        text = "sim"
        return text.ljust(n, "m") if isinstance(n, int) and 0 < n <= 4096 else text
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        value: float = 1 if kind == "integer" else 1.5
        if isinstance(low, (int, float)) and not isinstance(low, bool) and value <= low:
            value = int(low) + 1 if kind == "integer" else low + 1.5
        high = schema.get("maximum")
        if isinstance(high, (int, float)) and not isinstance(high, bool) and value > high:
            value = int(high) if kind == "integer" else high
        return value
    return _SIMPLE.get(kind, {})


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else None)
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return "object"


def json_text(schema: dict[str, Any] | None, words: str) -> str:
    """The JSON answer: an instance of `schema`, else an object holding the words."""
    value = instance(schema) if schema is not None else {"answer": words}
    return _enc.encode(value).decode()


def pieces(text: str) -> list[tuple[str, bytes]]:
    """`text` as (piece, its JSON) tokens of PIECE_CHARS characters."""
    parts = [text[i:i + PIECE_CHARS] for i in range(0, len(text), PIECE_CHARS)]
    return [(p, _enc.encode(p)) for p in parts]


# --- log probabilities ------------------------------------------------------------------


def logprob(token: str, rank: int = 0) -> float:
    """A deterministic log probability of `token` (rank 0: the chosen one, the likeliest)."""
    h = hashlib.blake2b(token.encode(), digest_size=2).digest()
    return -round(0.01 + (h[0] / 255) * 0.5 + rank * 1.25, 4)


def _alternatives(token: str, k: int) -> list[str]:
    return [token] + [f"{token.strip() or '_'}~{i}" for i in range(1, k)]


def chat_logprobs(toks: list[str], top: int) -> dict[str, Any]:
    """OpenAI chat's `logprobs` of a choice (or of one chunk's tokens)."""
    k = max(0, min(top, MAX_TOP))
    content = []
    for t in toks:
        alts = [{"token": a, "logprob": logprob(a, r), "bytes": list(a.encode())}
                for r, a in enumerate(_alternatives(t, k))] if k else []
        content.append({"token": t, "logprob": logprob(t), "bytes": list(t.encode()),
                        "top_logprobs": alts})
    return {"content": content, "refusal": None}


def completion_logprobs(toks: list[str], top: int, offset: int = 0) -> dict[str, Any]:
    """OpenAI completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    k = max(1, min(top, MAX_TOP))
    offsets, pos = [], offset
    for t in toks:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": toks, "token_logprobs": [logprob(t) for t in toks],
            "top_logprobs": [{a: logprob(a, r) for r, a in enumerate(_alternatives(t, k))}
                             for t in toks],
            "text_offset": offsets}
