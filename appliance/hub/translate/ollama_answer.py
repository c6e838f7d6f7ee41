"""Ollama's answers from an OpenAI-speaking engine's (llama.cpp, vLLM, any `openai` upstream):
the other half of translate/ollama.py.

Theory of operation: `ChatConverter` turns a chat-completions answer into Ollama's
/api/chat or /api/generate answer -- NDJSON, one line per engine chunk with text, the tool
calls (arguments decoded, as Ollama gives them) in one line when the engine finished them,
and the last line `done: true` with `done_reason`, the counts from the engine's usage
(counted by the hub where it gives none, translate/usage.py) and durations from the hub's
own clock (llama.cpp's own `timings` where it sends them): the engine always streams, so
the first token's time splits prompt from eval. `EmbedConverter` does /api/embed and the
legacy /api/embeddings. The clock is injected so tests can pin durations.
"""

from __future__ import annotations

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
    enc,
    engine_object,
    parse_args,
)
from appliance.hub.translate.usage import WHOLE_LIMIT, Tally, Usage

_DONE_REASONS = {"stop": "stop", "length": "length", "tool_calls": "stop", "content_filter": "stop"}


def now_iso() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


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
