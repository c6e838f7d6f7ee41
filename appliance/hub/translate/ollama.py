"""Ollama's API onto an OpenAI-speaking engine (llama.cpp, vLLM, any `openai` upstream).

Theory of operation: `/api/chat` and `/api/generate` become `/v1/chat/completions`
(generate: the `system` and `prompt` as two messages), `/api/embed` and `/api/embeddings`
become `/v1/embeddings`. Options map onto OpenAI's sampling fields (num_predict ->
max_tokens; num_ctx and the other load-time options belong to the engine's start and are
dropped: such an engine's context is fixed when it loads the model, so a request whose
num_predict plus prompt cannot fit the context the node reports is refused with a 400 --
`context_floor` counts the prompt at its least possible size, as the hub has no
tokenizer); `think` becomes `chat_template_kwargs.enable_thinking` (llama.cpp's and
vLLM's switch for a template's thinking) or, as "low"/"medium"/"high",
`reasoning_effort`, and an engine's `reasoning_content` comes back as Ollama's
`thinking`; `format` becomes `response_format`; images become image content parts; tools
pass as they are (Ollama copied OpenAI's shape) and tool calls come back with their
arguments decoded, as Ollama gives them. The engine is always asked to stream, with its
usage (`stream_options.include_usage`); the answers are translate/ollama_answer.py's.
"""

from __future__ import annotations

import math
from typing import Any

from appliance.hub.translate.common import (
    bad,
    enc,
    image_url,
    integer,
    number,
    stop_list,
)
from appliance.hub.translate.ollama_answer import (  # the answers' half, named here too
    ChatConverter,
    EmbedConverter,
    now_iso,
    unload_answer,
)

__all__ = ["ChatConverter", "EmbedConverter", "chat_request", "context_floor", "embed_request",
           "generate_request", "keep_alive_seconds", "now_iso", "too_long", "unload_answer"]

# Ollama's options that are sampling fields of an OpenAI request, by their OpenAI name.
# top_k, min_p, repeat_penalty are llama.cpp's and vLLM's extensions of the same body.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "min_p": "min_p", "repeat_penalty": "repeat_penalty"}


def _options(obj: dict[str, Any], out: dict[str, Any]) -> None:
    o = obj.get("options")
    if o is None:
        return
    if not isinstance(o, dict):
        raise bad("'options' must be an object", "options")
    for k, target in _OPTIONS.items():
        v = integer(o, k, f"options.{k}") if k == "seed" else number(o, k, f"options.{k}")
        if v is not None:
            out[target] = v
    n = integer(o, "num_predict", "options.num_predict")
    if n is not None and n >= 0:
        out["max_tokens"] = n
    stop = stop_list(o.get("stop"), "options.stop")
    if stop:
        out["stop"] = stop
    integer(o, "num_ctx", "options.num_ctx")  # checked, not sent: see context_floor


def _think(obj: dict[str, Any], out: dict[str, Any]) -> None:
    t = obj.get("think")
    if t is None:
        return
    if isinstance(t, bool):
        out["chat_template_kwargs"] = {"enable_thinking": t}
    elif t in ("low", "medium", "high"):
        out["reasoning_effort"] = t
        out["chat_template_kwargs"] = {"enable_thinking": True, "reasoning_effort": t}
    else:
        raise bad("'think' must be a boolean or \"low\", \"medium\", \"high\"", "think")


# The most bytes of text one token stands for in common vocabularies (runs of 64
# spaces or dashes are single tokens in some): a prompt is at least bytes / this.
BYTES_PER_TOKEN_MAX = 64


def context_floor(req: dict[str, Any]) -> int:
    """The fewest tokens a translated chat body can take of the context: its max_tokens
    plus the prompt at its least possible size (0 when max_tokens is not given: then the
    engine stops at the context's end, and that is no surprise to anyone)."""
    n = req.get("max_tokens")
    if not isinstance(n, int) or n <= 0:
        return 0
    size = 0
    for m in req.get("messages") or ():
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            size += len(c.encode())
        elif isinstance(c, list):
            size += sum(len(p["text"].encode()) for p in c
                        if isinstance(p, dict) and isinstance(p.get("text"), str))
    return n + max(1, -(-size // BYTES_PER_TOKEN_MAX))


def too_long(need: int, context: int) -> Exception:
    return bad(f"options.num_predict plus the prompt needs at least {need} tokens, more than "
               f"this model's context length ({context}); the engine's context is fixed when "
               "it loads the model (options.num_ctx cannot change it): ask for fewer tokens",
               "options.num_predict")


def _format(obj: dict[str, Any], out: dict[str, Any]) -> None:
    f = obj.get("format")
    if f is None or f == "":
        return
    if f == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(f, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "response",
                                                                         "schema": f}}
    else:
        raise bad("'format' must be \"json\" or a JSON schema object", "format")


def _images(images: Any, where: str) -> list[dict[str, Any]]:
    if images is None:
        return []
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise bad(f"'{where}' must be an array of base64 strings", where)
    return [{"type": "image_url", "image_url": {"url": image_url(i)}} for i in images]


def _message(m: Any, i: int, ids: list[str]) -> dict[str, Any]:
    """One Ollama chat message as OpenAI's; `ids` carries the tool-call ids handed out so
    far, so a later `tool` message answers the call it follows."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        raise bad(f"'{where}' must be an object with role system, user, assistant or tool", where)
    content = m.get("content", "")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string", f"{where}.content")
    out: dict[str, Any] = {"role": m["role"]}
    parts = _images(m.get("images"), f"{where}.images")
    out["content"] = ([{"type": "text", "text": content}] + parts) if parts else content
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise bad(f"'{where}.tool_calls' must be an array", f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"'{where}.tool_calls[{j}].function.name' must be a string",
                          f"{where}.tool_calls")
            args = fn.get("arguments", {})
            cid = c.get("id") if isinstance(c.get("id"),
                                            str) and c.get("id") else f"call_{len(ids)}"
            ids.append(cid)
            out["tool_calls"].append({"id": cid, "type": "function", "function": {
                "name": fn["name"], "arguments": args if isinstance(args, str)
                else enc.encode(args).decode()}})
    if m["role"] == "tool":
        tid = m.get("tool_call_id")
        out["tool_call_id"] = tid if isinstance(tid, str) and tid else (ids.pop(0) if ids
                                                                        else "call_0")
    return out


def chat_request(obj: dict[str, Any], model: str) -> tuple[dict[str, Any], bool]:
    """(OpenAI body, stream) for an Ollama /api/chat body."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    ids: list[str] = []
    out: dict[str, Any] = {"model": model, "messages": [_message(m, i, ids) for i,
                                                        m in enumerate(msgs)]}
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be an array", "tools")
        if tools:
            out["tools"] = tools
    return _common(obj, out)


def generate_request(obj: dict[str, Any], model: str) -> tuple[dict[str, Any], bool]:
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string", "prompt")
    msgs: list[dict[str, Any]] = []
    system = obj.get("system")
    if isinstance(system, str) and system:
        msgs.append({"role": "system", "content": system})
    parts = _images(obj.get("images"), "images")
    msgs.append({"role": "user", "content": ([{"type": "text", "text": prompt}] + parts) if parts
                 else prompt})
    return _common(obj, {"model": model, "messages": msgs})


def _common(obj: dict[str, Any], out: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    stream = obj.get("stream", True)
    if stream is None:
        stream = True
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    _options(obj, out)
    _think(obj, out)
    _format(obj, out)
    # The engine streams whatever the client asked: the first token's time is the split
    # between prompt and eval durations (ChatConverter), and the usage comes with it.
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return out, stream


def embed_request(obj: dict[str, Any], model: str, legacy: bool) -> dict[str, Any]:
    key = "prompt" if legacy else "input"
    x = obj.get(key)
    if legacy:
        if not isinstance(x, str):
            raise bad("'prompt' must be a string", "prompt")
    elif not (isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(i, str)
                                                                       for i in x))):
        raise bad("'input' must be a string or a non-empty array of strings", "input")
    out: dict[str, Any] = {"model": model, "input": x}
    dims = integer(obj, "dimensions")
    if dims is not None:
        out["dimensions"] = dims
    return out


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(v: object) -> float | None:
    """Ollama's `keep_alive` in seconds: a number of seconds or a Go duration ("5m",
    "1h30m", "0"); negative means until unloaded (inf). None when absent."""
    if v is None:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return math.inf if v < 0 else float(v)
    if not isinstance(v, str) or not v.strip():
        raise bad("'keep_alive' must be a number of seconds or a duration like \"5m\"",
                  "keep_alive")
    text = v.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    try:
        return math.inf if sign < 0 and float(text) != 0 else float(text)
    except ValueError:
        pass
    total, num = 0.0, ""
    i = 0
    while i < len(text):
        c = text[i]
        if c.isdigit() or c == ".":
            num += c
            i += 1
            continue
        unit = next((u for u in ("ns", "us", "µs", "ms", "h", "m", "s") if text.startswith(u, i)),
                    None)
        if unit is None or not num:
            raise bad(f"'keep_alive' {v!r} is not a duration", "keep_alive")
        total += float(num) * _UNITS[unit]
        num, i = "", i + len(unit)
    if num:
        raise bad(f"'keep_alive' {v!r} is not a duration (no unit after {num})", "keep_alive")
    return math.inf if sign < 0 and total else total
