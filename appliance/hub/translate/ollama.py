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
arguments decoded, as Ollama gives them. A streamed answer is NDJSON, one line per
engine chunk with text, the tool calls in one line when the engine finished them, and
the last line `done: true` with `done_reason`, the counts from the engine's usage
(asked for with `stream_options.include_usage`; counted by the hub where it gives none,
translate/usage.py) and durations from the hub's own clock (llama.cpp's own `timings`
where it sends them): the engine always streams, so the first token's time splits prompt
from eval. The clock is injected so tests can pin durations.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from appliance.hub.translate.common import (
    Buffered,
    SSEReader,
    Start,
    ToolCallAccumulator,
    bad,
    enc,
    engine_object,
    image_url,
    integer,
    number,
    parse_args,
    stop_list,
)
from appliance.hub.translate.usage import WHOLE_LIMIT, Tally, Usage

# Ollama's options that are sampling fields of an OpenAI request, by their OpenAI name.
# top_k, min_p, repeat_penalty are llama.cpp's and vLLM's extensions of the same body.
_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "min_p": "min_p", "repeat_penalty": "repeat_penalty"}
_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


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


# --- answers ---------------------------------------------------------------------------


def _ollama_calls(calls: Any) -> list[dict[str, Any]]:
    """OpenAI tool calls (whole, as in a message, or accumulated) as Ollama's."""
    out = []
    for c in calls if isinstance(calls, list) else []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        out.append({"function": {"name": fn.get("name", ""),
                                 "arguments": parse_args(fn.get("arguments"))}})
    return out


class ChatConverter:
    """An engine's chat-completions answer as Ollama's /api/chat or /api/generate answer.

    The engine is asked to stream whatever the client asked (`_common`), so the hub sees
    when the first token came: `prompt_eval_duration` is the time from sending to it,
    `eval_duration` from it to the end, `load_duration` the hub's own wait before sending
    (activation, queue) -- llama.cpp's `timings` replace the first two where it sends them.
    A client that asked for one answer gets the pieces gathered into it. An engine that
    answered whole anyway (the load request asks it to) is read whole."""

    def __init__(self, model: str, stream: bool, chat: bool, start: Start | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns, load_only: bool = False,
                 prompt: int = 0) -> None:
        self.model = model
        self.load_only = load_only  # Ollama's load request: the engine's token is not the answer
        self.stream = stream
        self.chat = chat
        self.content_type = b"application/x-ndjson" if stream else b"application/json"
        self._clock = clock
        now = clock()
        self._request_ns = start.request_ns if start is not None and start.request_ns else now
        self._sent_ns = start.sent_ns if start is not None and start.sent_ns else now
        self._first: int | None = None
        self._sse = SSEReader()
        self._events = 0
        self._raw: list[bytes] = []  # the engine's bytes until its first event
        self._raw_size = 0
        self._text: list[str] = []  # gathered for a client that asked for one answer
        self._thought: list[str] = []
        self._tools = ToolCallAccumulator()
        self._whole_calls: list[dict[str, Any]] = []
        self._finish = "stop"
        self._tally = Tally(prompt)
        self._timings: dict[str, Any] | None = None
        self._done = False

    def _line(self, text: str, calls: list[dict[str, Any]] | None = None,
              thinking: str = "") -> dict[str, Any]:
        base: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if self.chat:
            msg: Any = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            base["message"] = msg
        else:
            base["response"] = text
            if thinking:
                base["thinking"] = thinking
        base["done"] = False
        return base

    def durations(self, end: int) -> dict[str, int]:
        """Ollama's four durations (ns) at `end`, each at least 1 (clients divide by them),
        total at least the other three together."""
        load = max(1, self._sent_ns - self._request_ns)
        first = self._first if self._first is not None else end
        prompt_ns, eval_ns = first - self._sent_ns, end - first
        t = self._timings or {}
        if isinstance(t.get("prompt_ms"), (int, float)) and isinstance(t.get("predicted_ms"),
                                                                       (int, float)):
            prompt_ns, eval_ns = int(t["prompt_ms"] * 1e6), int(t["predicted_ms"] * 1e6)
        prompt_ns, eval_ns = max(1, prompt_ns), max(1, eval_ns)
        total = max(end - self._request_ns, load + prompt_ns + eval_ns)
        return {"total_duration": total, "load_duration": load,
                "prompt_eval_duration": prompt_ns, "eval_duration": eval_ns}

    def usage(self) -> Usage | None:
        return None if self.load_only else self._tally.usage()

    def _final(self, line: dict[str, Any]) -> dict[str, Any]:
        u = self._tally.usage() if not self.load_only else Usage()
        d = self.durations(self._clock())
        line.update({"done": True, "done_reason": _DONE_REASONS.get(self._finish, self._finish),
                     "total_duration": d["total_duration"], "load_duration": d["load_duration"],
                     "prompt_eval_count": u.input,
                     "prompt_eval_duration": d["prompt_eval_duration"],
                     "eval_count": u.output, "eval_duration": d["eval_duration"]})
        if not self.chat:
            line["context"] = []
        return line

    def _take(self, obj: dict[str, Any], whole: bool = False) -> tuple[str, str]:
        """(text, reasoning) of one chunk (or the whole body); counts, finish, timings and
        tool calls remembered."""
        if whole:
            self._tally.see_whole(obj)
        else:
            self._tally.see(obj)
        if isinstance(obj.get("timings"), dict):
            self._timings = obj["timings"]
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return "", ""
        ch = choices[0]
        if isinstance(ch.get("finish_reason"), str):
            self._finish = ch["finish_reason"]
        part = ch.get("message") if whole else ch.get("delta")
        if not isinstance(part, dict):
            return "", ""
        text: Any = part.get("content") if isinstance(part.get("content"), str) else ""
        r = part.get("reasoning_content")
        if whole:
            self._whole_calls = _ollama_calls(part.get("tool_calls"))
        elif self._tools.add(part.get("tool_calls")) and self._first is None:
            self._first = self._clock()
        return text, r if isinstance(r, str) else ""

    def feed(self, chunk: bytes) -> bytes:
        if not self._events and self._raw_size < WHOLE_LIMIT:
            self._raw.append(chunk)
            self._raw_size += len(chunk)
        out = []
        for data in self._sse.feed(chunk):
            self._events += 1
            if data == b"[DONE]":
                if self.stream:
                    out.append(self._end_line())
                continue
            try:
                obj = msgspec.json.decode(data)
            except (msgspec.DecodeError, RecursionError):
                continue
            if not isinstance(obj, dict):
                continue
            text, thinking = self._take(obj)
            if not (text or thinking):
                continue
            if self._first is None:
                self._first = self._clock()
            if self.stream:
                out.append(enc.encode(self._line(text, None, thinking)) + b"\n")
            else:
                self._text.append(text)
                self._thought.append(thinking)
        return b"".join(out)

    def _end_line(self) -> bytes:
        if self._done:
            return b""
        self._done = True
        out = b""
        calls = _ollama_calls(self._tools.whole())
        if calls:
            out = enc.encode(self._line("", calls)) + b"\n"
        return out + enc.encode(self._final(self._line(""))) + b"\n"

    def end(self) -> bytes:
        if not self._events and self._raw:  # answered whole, not streamed
            text, thinking = self._take(engine_object(b"".join(self._raw)), whole=True)
            self._text, self._thought = [text], [thinking]
            self._first = self._first or self._clock()
        if self.stream:
            if self._text:  # a whole answer for a streaming client: one line, then the last
                line = enc.encode(self._line("".join(self._text), None,
                                             "".join(self._thought))) + b"\n"
                return line + self._end_line()
            return self._end_line()
        if self._done:
            return b""
        self._done = True
        calls = self._whole_calls or _ollama_calls(self._tools.whole())
        text, thinking = "".join(self._text), "".join(self._thought)
        if self.load_only:
            text, calls, thinking, self._finish = "", [], "", "load"
        return enc.encode(self._final(self._line(text, calls, thinking)))


class EmbedConverter(Buffered):
    """An engine's /v1/embeddings answer as Ollama's /api/embed (or legacy /api/embeddings)."""

    def __init__(self, model: str, legacy: bool, start: Start | None = None,
                 clock: Callable[[], int] = time.perf_counter_ns, prompt: int = 0) -> None:
        self.model = model
        self.legacy = legacy
        self._clock = clock
        now = clock()
        self._request_ns = start.request_ns if start is not None and start.request_ns else now
        self._sent_ns = start.sent_ns if start is not None and start.sent_ns else now
        self._tally = Tally(prompt)

    def usage(self) -> Usage | None:
        u = self._tally.usage()
        return Usage(u.input, 0, u.cached, u.estimated)

    def _answer(self, obj: dict[str, Any]) -> bytes:
        self._tally.see_whole(obj)
        data = obj.get("data")
        rows = sorted((d for d in data if isinstance(d, dict)) if isinstance(data, list) else (),
                      key=lambda d: d.get("index", 0))
        vecs = [d.get("embedding", []) for d in rows]
        if self.legacy:
            return enc.encode({"embedding": vecs[0] if vecs else []})
        return enc.encode({"model": self.model, "embeddings": vecs,
                           "total_duration": max(1, self._clock() - self._request_ns),
                           "load_duration": max(1, self._sent_ns - self._request_ns),
                           "prompt_eval_count": self._tally.usage().input})


def unload_answer(model: str, chat: bool) -> bytes:
    """Ollama's answer to `{"model": m, "keep_alive": 0}`: nothing generated, done."""
    out: dict[str, Any] = {"model": model, "created_at": now_iso()}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    out.update(done=True, done_reason="unload")
    return enc.encode(out)


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
