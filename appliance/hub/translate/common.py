"""What every translation shares: body checks, SSE reading, and the engine's errors.

Theory of operation: a translation turns a client's body (already decoded to plain JSON
values) into an OpenAI chat-completions body, and the engine's answer back, chunk by
chunk. The checks here raise `ApiError(400, "invalid_request", ..., param=...)` so a bad
field is the client's 400 in its own API's shape, never the engine's 500 (a forwarded
OpenAI body's own checks are translate/__init__.py's). `SSEReader` cuts an engine's
`text/event-stream` into `data:` payloads whatever the chunking; an engine's refusal is
translate/errors.py's. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from appliance.http.errors import ApiError
from appliance.http.lines import LineEncoder
from appliance.hub.translate.usage import Tally, Usage

enc = LineEncoder()  # lines escaped: appliance/http/lines.py
# A single SSE line from an engine: a chunk of a few tokens is < 1 KiB; 1 MiB is absurd.
SSE_LINE_LIMIT = 1024 * 1024


class Start(NamedTuple):
    """When the hub got the request and when it sent it to a node (perf_counter_ns): the
    clock a translation's durations are read from."""

    request_ns: int
    sent_ns: int


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, "invalid_request", message, param=param)


def decode_object(body: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "body is not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    return obj


def opt(obj: dict[str, Any], key: str, types: type | tuple[type, ...], what: str,
        param: str | None = None) -> Any:
    """obj[key] if present and of `types` (None counts as absent), else a 400 naming it."""
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(f"'{param or key}' must be {what}", param or key)
    if not isinstance(v, types):
        raise bad(f"'{param or key}' must be {what}", param or key)
    return v


def number(obj: dict[str, Any], key: str, param: str | None = None) -> float | int | None:
    v: float | int | None = opt(obj, key, (int, float), "a number", param)
    return v


def integer(obj: dict[str, Any], key: str, param: str | None = None) -> int | None:
    v: int | None = opt(obj, key, int, "an integer", param)
    return v


# The sampling fields Anthropic Messages and OpenAI Responses share with chat completions.
SAMPLING = ("temperature", "top_p")


def copy_sampling(obj: dict[str, Any], out: dict[str, Any],
                  keys: tuple[str, ...] = SAMPLING) -> None:
    """Copy the numeric sampling fields `keys` from a client's body into a chat body, each
    checked (a 400 naming it) and left out when absent."""
    for k in keys:
        v = number(obj, k)
        if v is not None:
            out[k] = v


def stop_list(v: Any, param: str) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise bad(f"'{param}' must be a string or a list of strings", param)


def image_url(b64: str) -> str:
    """An Ollama image (bare base64) as a data: URL, its type read from the magic bytes."""
    for prefix, mime in (("iVBOR", "image/png"), ("/9j/", "image/jpeg"), ("R0lG", "image/gif"),
                         ("UklG", "image/webp")):
        if b64.startswith(prefix):
            return f"data:{mime};base64,{b64}"
    return f"data:image/jpeg;base64,{b64}"


def engine_object(body: bytes) -> dict[str, Any]:
    """An engine's JSON answer as an object; anything else (not JSON, nested too deeply, not
    an object) as {}, so what is missing reads as empty rather than failing the request."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}


class SSEReader:
    """Feed raw bytes, get the `data:` payloads of complete events (b"[DONE]" included).
    A read holding many events is split once (no copy of the rest per line)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buf + chunk if self._buf else chunk
        end = data.rfind(b"\n")
        if end < 0:
            # not an event anyone can use past the limit: dropped, not held
            self._buf = data if len(data) <= SSE_LINE_LIMIT else b""
            return []
        rest = data[end + 1:]
        self._buf = rest if len(rest) <= SSE_LINE_LIMIT else b""
        return [line[5:].strip() for line in data[:end].split(b"\n")
                if line.startswith(b"data:")]


def usage_of(obj: dict[str, Any]) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of an OpenAI body or chunk, 0 when absent."""
    u = obj.get("usage")
    if not isinstance(u, dict):
        return 0, 0
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    return (p if isinstance(p, int) else 0), (c if isinstance(c, int) else 0)


def parse_args(s: Any) -> Any:
    """Tool-call arguments as the engine sent them (a JSON string) as a value; text kept."""
    if not isinstance(s, str):
        return s if s is not None else {}
    try:
        return msgspec.json.decode(s) if s.strip() else {}
    except msgspec.DecodeError:
        return s


class ToolCallAccumulator:
    """Streamed tool-call deltas (OpenAI sends id and name first, arguments in pieces)
    gathered into whole calls, in index order."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: Any) -> list[tuple[int, dict[str, Any], str]]:
        """Returns (index, call-so-far, new argument text) per delta, for relays that stream
        them."""
        out: list[tuple[int, dict[str, Any], str]] = []
        if not isinstance(deltas, list):
            return out
        for d in deltas:
            if not isinstance(d, dict):
                continue
            idx = d.get("index", len(self.calls))
            if not isinstance(idx, int):
                idx = len(self.calls)
            call = self.calls.setdefault(idx, {"id": "", "name": "", "arguments": ""})
            if isinstance(d.get("id"), str) and d["id"]:
                call["id"] = d["id"]
            fn: Any = d.get("function") if isinstance(d.get("function"), dict) else {}
            if isinstance(fn.get("name"), str) and fn["name"]:
                call["name"] = fn["name"]
            piece: Any = fn.get("arguments") if isinstance(fn.get("arguments"), str) else ""
            call["arguments"] += piece
            out.append((idx, call, piece))
        return out

    def whole(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]


class EventsConverter:
    """An engine's chat-completions answer as another API's answer: buffered whole and
    rendered by `_whole`, or, streamed, each engine chunk through `_chunk` after `_start`, and
    `_finish_events` once at `[DONE]` or the end. Subclasses set `stream`, `_buf`, `_sse`
    and `_tally` (which every chunk, and a whole answer, is shown to)."""

    stream: bool
    _buf: Whole
    _sse: SSEReader
    _tally: Tally

    def usage(self) -> Usage | None:
        return self._tally.usage()

    def _whole(self) -> bytes:
        raise NotImplementedError

    def _start(self) -> list[bytes]:
        raise NotImplementedError

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def _finish_events(self) -> list[bytes]:
        raise NotImplementedError

    def feed(self, chunk: bytes) -> bytes:
        if not self.stream:
            self._buf.add(chunk)
            return b""
        out = self._start()
        for data in self._sse.feed(chunk):
            if data == b"[DONE]":
                out += self._finish_events()
                continue
            try:
                obj = msgspec.json.decode(data)
            except (msgspec.DecodeError, RecursionError):
                continue
            if isinstance(obj, dict):
                self._tally.see(obj)
                out += self._chunk(obj)
        return b"".join(out)

    def end(self) -> bytes:
        if not self.stream:
            return self._whole()
        return b"".join(self._finish_events())


# The most of an engine's whole answer a translation holds to decode it: Hub__MaxBufferedBytes'
# default. Past it the rest is dropped and the answer reads as empty (no engine answers a
# chat with 256 MiB of JSON; one that does is broken or hostile).
MAX_WHOLE_BYTES = 256 * 1024 * 1024


class Whole:
    """An engine's whole answer gathered in pieces and joined once: a `bytes +=` per chunk
    copied everything so far each time (a 200 MB answer held a core for minutes)."""

    __slots__ = ("parts", "size", "over")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.over = False

    def add(self, chunk: bytes) -> None:
        if self.over or self.size + len(chunk) > MAX_WHOLE_BYTES:
            self.over, self.parts = True, []
            return
        self.parts.append(chunk)
        self.size += len(chunk)

    def take(self) -> bytes:
        """The answer, joined (b"" when it ran past MAX_WHOLE_BYTES)."""
        whole = b"".join(self.parts)
        self.parts = [whole] if whole else []
        return whole


class Buffered:
    """A converter that answers once the engine's whole body is in (`_answer`)."""

    content_type = b"application/json"
    _whole: Whole | None = None

    def _answer(self, obj: dict[str, Any]) -> bytes:
        raise NotImplementedError

    def usage(self) -> Usage | None:
        return None

    def feed(self, chunk: bytes) -> bytes:
        if self._whole is None:
            self._whole = Whole()
        self._whole.add(chunk)
        return b""

    def end(self) -> bytes:
        return self._answer(engine_object(self._whole.take() if self._whole else b""))
