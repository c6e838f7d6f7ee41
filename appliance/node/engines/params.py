"""The request fields each engine takes: a client's OpenAI body fitted to the engine.

Theory of operation: the hub sends OpenAI's names as clients send them today --
`max_completion_tokens` (LangChain's ChatOpenAI sends only that), `response_format` of type
`json_schema` (`chat.completions.parse`, and what the hub makes of Ollama's `format`,
Anthropic's `output_config.format` and Responses' `text.format`). Engines differ, and only
the node knows which one serves a model, so the node fits the body before it forwards it
(`fit`). The dialects:

- `llama-cpp-python` (`python -m llama_cpp.server`): takes only `max_tokens` -- it ignores
  `max_completion_tokens` and generates until the context is full, and the next requests
  fail with `llama_decode returned 1` -- and refuses `json_schema`; it takes `json_object`
  with a `schema` (llama_cpp/llama_chat_format.py `_grammar_for_response_format`).
- `ollama` (Ollama's OpenAI routes): `max_tokens`; `json_schema` as OpenAI.
- `openai` (llama-server, vLLM, the sim, any other upstream): as OpenAI -- llama-server
  takes `max_completion_tokens` as an alias of `n_predict` and `json_schema`.

A body that names neither field passes untouched (two substring scans, no decode), as does
one that is not a JSON object: the engine's answer to it is the engine's.
"""

from __future__ import annotations

from typing import Any

import msgspec

Dialect = str  # "openai", "llama-cpp-python" or "ollama"
OPENAI, LLAMA_CPP_PYTHON, OLLAMA = "openai", "llama-cpp-python", "ollama"
# The routes whose bodies carry a generation cap or a response format.
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_enc = msgspec.json.Encoder()


def _cap_as_max_tokens(obj: dict[str, Any]) -> bool:
    """`max_completion_tokens` as `max_tokens` (a `max_tokens` given too wins, as OpenAI's
    own precedence has it for the engines that take both)."""
    if "max_completion_tokens" not in obj:
        return False
    cap = obj.pop("max_completion_tokens")
    if obj.get("max_tokens") is None and cap is not None:
        obj["max_tokens"] = cap
    return True


def _schema_as_json_object(obj: dict[str, Any]) -> bool:
    """`{"type": "json_schema", "json_schema": {"schema": S}}` as `{"type": "json_object",
    "schema": S}` (llama-cpp-python's form)."""
    rf = obj.get("response_format")
    if not isinstance(rf, dict) or rf.get("type") != "json_schema":
        return False
    js = rf.get("json_schema")
    schema = js.get("schema") if isinstance(js, dict) else None
    obj["response_format"] = ({"type": "json_object", "schema": schema}
                              if isinstance(schema, dict) else {"type": "json_object"})
    return True


def fit(dialect: Dialect, path: str, body: bytes) -> bytes:
    """`body` as the engine of `dialect` takes it on `path`."""
    if dialect == OPENAI or path not in ROUTES:
        return body
    cap = b"max_completion_tokens" in body
    schema = dialect == LLAMA_CPP_PYTHON and b"json_schema" in body
    if not (cap or schema):
        return body
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return body
    if not isinstance(obj, dict):
        return body
    changed = _cap_as_max_tokens(obj) if cap else False
    if schema:
        changed = _schema_as_json_object(obj) or changed
    return _enc.encode(obj) if changed else body
