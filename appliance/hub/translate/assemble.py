"""A streamed chat or text completion gathered into the whole answer.

Theory of operation: the hub asks the engine to stream every generation, whatever the
client asked, so a client that leaves closes the engine's stream and frees its slot (an
engine answering whole generates on for a client long gone: llama-server held its slot
10-19 s after `curl -m 0.5`; a stream stops at once). For a client that asked for one
answer, `Assembler` reads the engine's chunks and builds the answer the engine would have
sent whole: per choice the text (or message: content, reasoning, tool calls with their
arguments joined), logprobs, the finish reason and whatever else the engine names on it
(vLLM's `stop_reason`), the first chunk's id/created/model, the stream's usage (else the
hub's count, marked estimated, translate/usage.py). An engine that answered whole anyway
is taken as it is. In front of a translation (`inner`: a converter built for a whole
answer) the assembled answer is that converter's input; on a passed-through route it is
the answer itself. Sync and pure: tests feed it bytes.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from appliance.hub.translate.common import SSEReader, ToolCallAccumulator, enc
from appliance.hub.translate.stops import StopWatch
from appliance.hub.translate.usage import WHOLE_LIMIT, Tally, Usage, openai_usage

# Choice keys gathered piece by piece, or set by the assembler itself; any other key an
# engine puts on a choice chunk (vLLM's `stop_reason`) is kept as it last said it.
_GATHERED = frozenset({"index", "delta", "text", "logprobs", "finish_reason", "message"})
# Top-level keys of a chunk that are not the answer's (the rest is kept from the first).
_NOT_KEPT = frozenset({"object", "choices", "usage"})


class Whole(Protocol):
    """A converter built for an engine's whole answer (translate/anthropic.py's, ...)."""

    content_type: bytes

    def feed(self, chunk: bytes) -> bytes: ...

    def end(self) -> bytes: ...

    def usage(self) -> Usage | None: ...


class _Choice:
    __slots__ = ("text", "reasoning", "tools", "logprobs", "legacy", "finish", "extra", "role")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tools = ToolCallAccumulator()
        self.logprobs: list[Any] | None = None
        self.legacy: dict[str, list[Any]] | None = None  # text completions' logprobs
        self.finish: Any = None
        self.extra: dict[str, Any] = {}
        self.role = "assistant"


class Assembler:
    """`chat`: chat.completion chunks (else text_completion). `inner`: the translation the
    whole answer is for (None: the answer is passed on as OpenAI's)."""

    def __init__(self, prompt: int, chat: bool, inner: Whole | None = None,
                 stops: list[str] | None = None) -> None:
        self.chat = chat
        self.inner = inner
        # Stop sequences the hub matches (translate/stops.py): once one is in the first
        # choice's text the answer is `finished` and the engine's stream is read no more.
        self._watch = StopWatch(stops) if stops else None
        self.finished = False
        self.content_type = inner.content_type if inner is not None else b"application/json"
        self._tally = Tally(prompt)
        self._sse = SSEReader()
        self._whole: bool | None = None  # decided at the first byte that is not a space
        self._raw: list[bytes] = []
        self._size = 0
        self._meta: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._timings: Any = None
        self._usage: dict[str, Any] | None = None

    def usage(self) -> Usage | None:
        if self._whole and self.inner is not None:
            return self.inner.usage()
        return self._tally.usage()

    def feed(self, chunk: bytes) -> bytes:
        if self._whole is None:
            head = chunk.lstrip()
            if not head:
                return b""
            self._whole = head.startswith(b"{")
        if self._whole:
            self._size += len(chunk)
            if self._size <= WHOLE_LIMIT:
                self._raw.append(chunk)
            return b""
        for data in self._sse.feed(chunk):
            if data == b"[DONE]":
                continue
            try:
                obj = msgspec.json.decode(data)
            except (msgspec.DecodeError, RecursionError):
                continue
            if isinstance(obj, dict):
                self._take(obj)
        return b""

    def end(self) -> bytes:
        if self._whole:
            raw = b"".join(self._raw)
            if self.inner is not None:
                return self.inner.feed(raw) + self.inner.end()
            try:
                obj = msgspec.json.decode(raw)
            except (msgspec.DecodeError, RecursionError):
                obj = None
            if isinstance(obj, dict):
                self._tally.see_whole(obj)
            return raw
        answer = self.answer()
        if self.inner is not None:
            return self.inner.feed(enc.encode(answer)) + self.inner.end()
        return enc.encode(answer)

    # --- gathering ---------------------------------------------------------------------

    def _take(self, obj: dict[str, Any]) -> None:
        """One chunk gathered, and counted on the way as `Tally.see` counts one. Most chunks
        are one choice whose delta is only `content`: that one is read with the fewest
        look-ups (the delta's other keys only where it has some)."""
        if not self._meta:
            self._meta = {k: v for k, v in obj.items() if k not in _NOT_KEPT}
        usage = obj.get("usage")
        if usage is not None and isinstance(usage, dict):
            self._usage = usage  # the engine's, as it said it (cached tokens too)
            self._tally.found = openai_usage(obj)
        if obj.get("timings") is not None:
            self._timings = obj["timings"]  # llama-server's, on its last chunk
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        generated = False
        for ch in choices:
            if not isinstance(ch, dict):
                continue
            idx = ch.get("index", 0)
            at = idx if isinstance(idx, int) else 0
            c = self._choices.get(at)
            if c is None:
                c = self._choices[at] = _Choice()
            text = ch.get("text")
            if text and isinstance(text, str):
                generated = True
            d = ch.get("delta")
            content = None
            if d is not None and isinstance(d, dict):
                content = d.get("content")
                if content:
                    generated = True
                if content is None or len(d) > 1:
                    reasoning, calls, role = (d.get("reasoning_content"), d.get("tool_calls"),
                                              d.get("role"))
                    if reasoning or calls:
                        generated = True
                    if isinstance(reasoning, str):
                        c.reasoning.append(reasoning)
                    if isinstance(role, str):
                        c.role = role
                    if calls:
                        c.tools.add(calls)
            piece = content if self.chat else text
            if isinstance(piece, str):
                c.text.append(piece)
                if self._watch is not None and idx == 0:
                    self._watch.feed(piece)
                    self.finished = self._watch.matched is not None
            lp = ch.get("logprobs")
            if lp is not None and isinstance(lp, dict):
                if isinstance(lp.get("content"), list):
                    if c.logprobs is None:
                        c.logprobs = []
                    c.logprobs += lp["content"]
                elif isinstance(lp.get("tokens"), list):
                    c.legacy = _joined(c.legacy, lp)  # a text completion's lists, joined
            finish = ch.get("finish_reason")
            if finish is not None:
                c.finish = finish
            if not ch.keys() <= _GATHERED:
                for k, v in ch.items():
                    if k not in _GATHERED and v is not None:
                        c.extra[k] = v
        if generated:
            self._tally.chunks += 1

    def answer(self) -> dict[str, Any]:
        """The whole answer from what was gathered."""
        out: dict[str, Any] = {**self._meta, "object": "chat.completion" if self.chat
                               else "text_completion", "choices": []}
        for idx in sorted(self._choices) or [0]:
            c = self._choices.get(idx) or _Choice()
            choice: dict[str, Any] = {"index": idx}
            text = "".join(c.text)
            if self.chat:
                calls = [{"id": t["id"] or f"call_{i}", "type": "function",
                          "function": {"name": t["name"], "arguments": t["arguments"]}}
                         for i, t in enumerate(c.tools.whole())]
                msg: dict[str, Any] = {"role": c.role,
                                       "content": text if text or not calls else None}
                if c.reasoning:
                    msg["reasoning_content"] = "".join(c.reasoning)
                if calls:
                    msg["tool_calls"] = calls
                choice["message"] = msg
            else:
                choice["text"] = text
            choice["logprobs"] = ({"content": c.logprobs} if c.logprobs is not None
                                  else c.legacy)
            choice["finish_reason"] = c.finish or "stop"
            choice.update(c.extra)
            out["choices"].append(choice)
        u = self._tally.usage()
        out["usage"] = self._usage if self._usage is not None else {
            "prompt_tokens": u.input, "completion_tokens": u.output,
            "total_tokens": u.input + u.output}
        if self._timings is not None:
            out["timings"] = self._timings
        return out


# The lists of a text completion's `logprobs`, one entry per token.
_LEGACY = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _joined(have: dict[str, list[Any]] | None, lp: dict[str, Any]) -> dict[str, list[Any]]:
    out = have if have is not None else {k: [] for k in _LEGACY}
    for k in _LEGACY:
        v = lp.get(k)
        if isinstance(v, list):
            out[k] += v
    return out


def streamed(req: dict[str, Any]) -> dict[str, Any]:
    """A chat or completion body asking the engine to stream, with its usage."""
    so = req.get("stream_options")
    return {**req, "stream": True,
            "stream_options": {**(so if isinstance(so, dict) else {}), "include_usage": True}}


def assembled_openai(conv: object) -> bool:
    """Is `conv` an assembler whose answer is OpenAI's own (its usage and llama-server's
    `timings` tell affinity of the prompt cache, as a passed-through answer's do)?"""
    return isinstance(conv, Assembler) and conv.inner is None
