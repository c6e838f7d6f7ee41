"""Token counts of one answer: what the engine said, or what the hub counted.

Theory of operation: every answer the hub relays ends with a `Usage` on its `Request`
(input, output and cached prompt tokens; `estimated` when the hub counted them itself) --
what token limits, `appliance_tokens_total` and the prompt-cache figures read. The engine's
own counts come first: OpenAI's `usage` (the hub asks for it on streams with
`stream_options.include_usage`, and drops that chunk again when the client did not ask),
Ollama's `prompt_eval_count` / `eval_count`. An engine that gives none (llama-cpp-python
ignores `include_usage`) is counted: one output token per generated chunk (an engine sends
one token per chunk), the prompt estimated from the client's body at BYTES_PER_TOKEN (its
bytes less images and the JSON around each message: `prompt_estimate`).

A passed-through answer is read by a meter (`SSEMeter`, `NDJSONMeter`, `JSONMeter`): a
converter that hands each read's bytes on unchanged -- bar the usage chunk the client did
not ask for -- and parses only complete events; a translated one counts in its converter.
Sync and pure, no I/O: tests feed them bytes.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

# OpenAI's rule of thumb for English text: a token is about 4 characters (bytes for ASCII).
BYTES_PER_TOKEN = 4
# A whole (non-streamed) answer is parsed for its usage up to this size; past it only its
# head and tail are kept (usage sits at one end: vLLM's last, llama-server's keys sorted).
WHOLE_LIMIT = 4 * 1024 * 1024
EDGE_BYTES = 64 * 1024
# One SSE event or NDJSON line held while incomplete: a chunk is < 1 KiB; past this it is
# not one the hub parses (the bytes still pass).
EVENT_LIMIT = 1024 * 1024
# Body keys whose strings are not prompt text: images (base64 or URLs), a part's type.
_NOT_TEXT = frozenset({"images", "image_url", "source", "input_image", "type"})
_USAGE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})')


class Usage(msgspec.Struct):
    """Tokens of one request: prompt (`input`, of which `cached` came from the engine's
    prompt cache) and generated (`output`); `estimated`: counted by the hub. `cache`:
    (prompt, cached) tokens where the engine spoke of its prompt cache -- vLLM's
    `usage.prompt_tokens_details.cached_tokens`, llama-server's `timings.cache_n` +
    `prompt_n` -- which affinity weighs its predictions with (None: it said nothing)."""

    input: int = 0
    output: int = 0
    cached: int = 0
    estimated: bool = False
    cache: tuple[int, int] | None = None


def estimate(nbytes: int) -> int:
    return -(-nbytes // BYTES_PER_TOKEN) if nbytes > 0 else 0


def text_bytes(v: Any, depth: int = 0) -> int:
    """Bytes of the text in a body's value (messages, prompt, input): strings, nested."""
    if isinstance(v, str):
        return len(v.encode())
    if depth > 8:
        return 0
    if isinstance(v, list):
        return sum(text_bytes(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return sum(text_bytes(x, depth + 1) for k, x in v.items() if k not in _NOT_TEXT)
    return 0


# JSON around one message's text (`{"role":"user","content":""},`): not prompt text.
MESSAGE_JSON_BYTES = 32
# Where an image's base64 starts, by API: a data: URL (OpenAI, Responses), Anthropic's
# base64 source, Ollama's `images` array (up to its `]`).
_IMAGE_MARKS = (b"base64,", b'"data":"', b'"data": "')


def prompt_estimate(body: bytes) -> int:
    """The prompt of a client's body (any API), in tokens at BYTES_PER_TOKEN: its bytes less
    its images and the JSON around each message -- the hub has no tokenizer, and this is
    only what an engine that counts nothing is charged. Images (base64) are found by their
    markers, not decoded: a 30 MB body of a million messages is scanned in milliseconds."""
    images = 0
    for mark in _IMAGE_MARKS:
        i = body.find(mark)
        while i >= 0:
            end = body.find(b'"', i + len(mark))
            if end < 0:
                break
            if mark == b"base64," or end - i > 256:  # a short "data" field is text
                images += end - i
            i = body.find(mark, end)
    i = body.find(b'"images"')
    while i >= 0:
        end = body.find(b"]", i)
        if end < 0:
            break
        images += end - i
        i = body.find(b'"images"', end)
    text = len(body) - images - MESSAGE_JSON_BYTES * body.count(b'"role"')
    return -(-text // BYTES_PER_TOKEN) if text > 0 else 0  # estimate(text)


def openai_usage(obj: dict[str, Any]) -> Usage | None:
    """The usage of an OpenAI body or chunk (chat, completion, embedding), None if absent;
    its `cache` (prompt, cached tokens) where the engine spoke of its prompt cache:
    llama-server's `timings.cache_n` + `prompt_n`, else the usage's own
    `prompt_tokens_details.cached_tokens` (JSON numbers: `type(v) is int` leaves out bools)."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    d = u.get("prompt_tokens_details")
    hit = d.get("cached_tokens") if isinstance(d, dict) else None
    cache = None
    t = obj.get("timings")
    if isinstance(t, dict):
        n, tp = t.get("cache_n"), t.get("prompt_n")
        if type(n) is int and type(tp) is int:
            cache = max(0, n) + max(0, tp), max(0, n)
    if cache is None and type(p) is int and type(hit) is int:
        cache = max(0, p), min(max(0, p), max(0, hit))
    return Usage(p if isinstance(p, int) else 0, c if isinstance(c, int) else 0,
                 hit if isinstance(hit, int) else 0, cache=cache)


def ollama_usage(obj: dict[str, Any]) -> Usage | None:
    """Ollama's counts on a last line (or an embed answer), None if absent."""
    p, c = obj.get("prompt_eval_count"), obj.get("eval_count")
    if not isinstance(p, int) and not isinstance(c, int):
        return None
    return Usage(p if isinstance(p, int) else 0, c if isinstance(c, int) else 0)


def _decode(data: bytes) -> dict[str, Any] | None:
    try:
        obj = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _generated(obj: dict[str, Any]) -> bool:
    """Does this chunk carry a generated piece (text, reasoning, a tool call's)?"""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        if isinstance(ch.get("text"), str) and ch["text"]:
            return True
        d = ch.get("delta")
        if isinstance(d, dict) and (d.get("content") or d.get("reasoning_content")
                                    or d.get("tool_calls")):
            return True
    return False


def _answer_text(obj: dict[str, Any]) -> int:
    """Bytes of the generated text of a whole answer (OpenAI's or Ollama's)."""
    n = 0
    for ch in obj.get("choices") or ():
        if isinstance(ch, dict):
            n += text_bytes(ch.get("text")) + text_bytes(ch.get("message"))
    return n + text_bytes(obj.get("message")) + text_bytes(obj.get("response"))


class Tally:
    """One answer's counts as they come: the engine's usage when it gives one, else the
    generated chunks (or a whole answer's text) and the prompt's estimate."""

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt  # the estimate, for an engine that gives no usage
        self.found: Usage | None = None
        self.chunks = 0
        self.text = 0  # bytes of generated text in a whole answer (for its estimate)

    def see(self, obj: dict[str, Any]) -> None:
        """One streamed chunk (OpenAI's)."""
        u = openai_usage(obj)
        if u is not None:
            self.found = u
        if _generated(obj):
            self.chunks += 1

    def see_whole(self, obj: dict[str, Any]) -> None:
        """A whole answer (OpenAI's)."""
        self.found = openai_usage(obj)
        self.text = _answer_text(obj)

    def usage(self) -> Usage:
        if self.found is not None:
            return self.found
        return Usage(self.prompt, self.chunks or estimate(self.text), 0, estimated=True)


class Meter(Tally):
    """A passed-through answer's tally; the node's content type and length stand."""

    content_type = b""

    def feed(self, chunk: bytes) -> bytes:
        raise NotImplementedError

    def end(self) -> bytes:
        raise NotImplementedError


# A generated piece in a chunk, as engines encode it (compact, or with Python's spaces);
# not an empty one (a role-only first chunk's `"content":""`). Complete events are counted
# on their bytes with one scan (no decode: this runs for every event of every stream
# passed through, bench/streams.py).
_PIECE = re.compile(rb'"(?:content|reasoning_content|text|arguments)": ?"(?!")')


class SSEMeter(Meter):
    """An OpenAI event stream, passed on; the usage-only chunk dropped when `drop` (then an
    incomplete event is held until its end, which engines send in the same write). Only an
    event that names `"usage"` is decoded; the others are counted on their bytes."""

    def __init__(self, prompt: int, drop: bool) -> None:
        super().__init__(prompt)
        self.drop = drop
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        sep = b"\n\n" if b"\r" not in data else b"\r\n\r\n"
        end = data.rfind(sep)
        if end < 0:
            self._carry = data if len(data) <= EVENT_LIMIT else b""
            if not self.drop:
                return chunk
            return b"" if self._carry else data  # too long to be an event: passed on
        cut = end + len(sep)
        whole, rest = data[:cut], data[cut:]
        self._carry = rest if len(rest) <= EVENT_LIMIT else b""
        if b'"usage"' in whole:
            kept = self._with_usage(whole, sep)
        else:
            self.chunks += len(_PIECE.findall(whole))
            kept = whole
        if not self.drop:
            return chunk
        return kept if self._carry else kept + rest

    def _with_usage(self, whole: bytes, sep: bytes) -> bytes:
        """Complete events of which some name a usage: each decoded; the bytes to pass on
        when dropping (the usage-only chunk left out)."""
        kept: list[bytes] = []
        for event in whole.split(sep)[:-1]:
            i = event.find(b"data:")
            payload = event[i + 5:].strip() if i >= 0 and b'"usage"' in event else b""
            obj = _decode(payload) if payload else None
            if obj is None:
                self.chunks += len(_PIECE.findall(event))
                kept.append(event + sep)
                continue
            # `Tally.see`, where the usage-only chunk (its choices empty) is decoded for its
            # usage alone: nothing in it was generated.
            u = openai_usage(obj)
            if u is not None:
                self.found = u
            choices = obj.get("choices")
            if choices and _generated(obj):
                self.chunks += 1
            if not (self.drop and choices == [] and "usage" in obj):
                kept.append(event + sep)
        return b"".join(kept)

    def end(self) -> bytes:
        rest, self._carry = self._carry, b""
        return rest if self.drop else b""


class NDJSONMeter(Meter):
    """Ollama's line stream, passed on: the last line's counts, else one per line."""

    def __init__(self, prompt: int) -> None:
        super().__init__(prompt)
        self._carry = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        end = data.rfind(b"\n")
        lines, rest = (data[:end], data[end + 1:]) if end >= 0 else (b"", data)
        self._carry = rest if len(rest) <= EVENT_LIMIT else b""
        for line in lines.split(b"\n") if lines else ():
            obj = _decode(line)
            if obj is None:
                continue
            if obj.get("done") is True:
                self.found = ollama_usage(obj) or self.found
            else:
                self.chunks += 1
        return chunk

    def end(self) -> bytes:
        if self._carry:
            self.feed(b"\n")
        return b""


class JSONMeter(Meter):
    """A whole answer (OpenAI's or Ollama's), passed on; its usage read at the end."""

    def __init__(self, prompt: int, api: str) -> None:
        super().__init__(prompt)
        self.api = api
        self._head: list[bytes] = []
        self._tail = b""
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        self._size += len(chunk)
        if self._size <= WHOLE_LIMIT:
            self._head.append(chunk)
        else:
            self._tail = (self._tail + chunk)[-EDGE_BYTES:]
        return chunk

    def end(self) -> bytes:
        head = b"".join(self._head)
        obj = _decode(head) if not self._tail else None
        if obj is not None:
            self.see_whole(obj)
            if self.api == "ollama":
                self.found = ollama_usage(obj) or self.found
            return b""
        for edge in (self._tail, head[:EDGE_BYTES]):
            m = _USAGE.search(edge)
            u = _decode(b'{"usage":' + m.group(1) + b"}") if m is not None else None
            if u is not None:
                self.found = openai_usage(u)
                break
        return b""
