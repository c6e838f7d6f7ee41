"""Anthropic's Messages API (`POST /v1/messages`) onto OpenAI chat completions.

Theory of operation: every engine here speaks chat completions, so a Messages body always
becomes one: `system` (text or text blocks) the first message; each turn's blocks become
content parts (text, image as a data: or plain URL), `tool_use` blocks the assistant's
`tool_calls` (with their ids), `tool_result` blocks `tool` messages answering those ids;
`max_tokens` (required, as Anthropic requires it), `temperature`,
`top_p`, `top_k`, tools (`input_schema` -> `parameters`) and `tool_choice` map one to
one; structured output (`output_config.format`, a JSON schema) becomes `response_format`.
The answer comes back as a `message` with text and `tool_use` blocks, `stop_reason`
(end_turn, max_tokens, tool_use, stop_sequence) and usage; streamed, as Anthropic's event
sequence: message_start, ping, then per block content_block_start / _delta / _stop (text_delta or
input_json_delta), message_delta with the stop reason and the usage, message_stop.
Usage is the engine's, else the hub's count (translate/usage.py); message_start, sent
before the engine has counted anything, carries the prompt's estimate, and message_delta
the final input and output tokens (the SDKs take those). Ids are random.

Which stop sequence ended an answer: engines strip it from the text, and OpenAI's
finish_reason "stop" is the same for an end-of-sequence token and a stop sequence. So the
engine is not given `stop_sequences` (translate/__init__.py): the hub matches them in the
text itself (translate/stops.py), ends the answer at the first one with `stop_sequence`
named, and the relay closes the engine's stream. An engine that names one anyway (the
choice's `stop_reason`, vLLM and the sim; `stopping_word`) is still believed.
"""

from __future__ import annotations

import secrets
from typing import Any

from appliance.hub.translate.common import (
    Buffered,
    EventsConverter,
    SSEReader,
    Whole,
    bad,
    copy_sampling,
    enc,
    engine_object,
    integer,
    parse_args,
    stop_list,
)
from appliance.hub.translate.stops import StopWatch
from appliance.hub.translate.usage import Tally, Usage

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
         "content_filter": "end_turn"}


def new_id(prefix: str) -> str:
    """A random id (unique across hub restarts and hubs): 24 characters as Anthropic's."""
    return f"{prefix}{secrets.token_hex(12)}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for b in content:
            if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
        return "".join(texts)
    if content is None:
        return ""
    raise bad(f"'{where}' must be a string or an array of blocks", where)


def _image(b: dict[str, Any], where: str) -> dict[str, Any]:
    src = b.get("source")
    if isinstance(src, dict) and src.get("type") == "base64" and isinstance(src.get("data"), str):
        return {"type": "image_url",
                "image_url": {
                    "url": f"data:{src.get('media_type', 'image/png')};base64,{src['data']}"}}
    if isinstance(src, dict) and src.get("type") == "url" and isinstance(src.get("url"), str):
        return {"type": "image_url", "image_url": {"url": src["url"]}}
    raise bad(f"'{where}.source' must be a base64 or url image source", f"{where}.source")


def _turn(m: Any, i: int) -> list[dict[str, Any]]:
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise bad(f"{where}: role must be 'user' or 'assistant'", f"{where}.role")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or an array of content blocks",
                  f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        bw = f"{where}.content.{j}"
        t = b.get("type") if isinstance(b, dict) else None
        if t == "text":
            if not isinstance(b.get("text"), str):
                raise bad(f"{bw}.text must be a string", f"{bw}.text")
            parts.append({"type": "text", "text": b["text"]})
        elif t == "image":
            parts.append(_image(b, bw))
        elif t == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad(f"{bw}: tool_use needs a string id and name", bw)
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"],
                                       "arguments": enc.encode(b.get("input", {})).decode()}})
        elif t == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{bw}.tool_use_id must be a string", f"{bw}.tool_use_id")
            text = _text_of(b.get("content"), f"{bw}.content")
            if b.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        elif t in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad(f"{bw}: unsupported content block type {t!r}", f"{bw}.type")
    out = list(results)
    if role == "assistant":
        msg: Any = {"role": "assistant", "content": "".join(p["text"] for p in parts
                                                                       if p["type"] == "text")}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts) if only_text
                    else parts})
    return out


def _tools(obj: dict[str, Any], out: dict[str, Any]) -> None:
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools must be an array", "tools")
        conv = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise bad(f"tools.{i}.name must be a string", f"tools.{i}.name")
            schema = t.get("input_schema", {"type": "object"})
            conv.append({"type": "function", "function": {"name": t["name"],
                                                          "description": t.get("description", ""),
                                                          "parameters": schema}})
        if conv:
            out["tools"] = conv
    tc = obj.get("tool_choice")
    if isinstance(tc, dict):
        kind = tc.get("type")
        if kind == "any":
            out["tool_choice"] = "required"
        elif kind == "tool" and isinstance(tc.get("name"), str):
            out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
        elif kind in ("auto", "none"):
            out["tool_choice"] = kind
        if tc.get("disable_parallel_tool_use") is True:
            out["parallel_tool_calls"] = False


def _output_format(obj: dict[str, Any], out: dict[str, Any]) -> None:
    """Structured output: `output_config.format` (or the beta's `output_format`), a JSON
    schema, as chat's `response_format` -- which the node turns into what its engine takes."""
    cfg = obj.get("output_config")
    if cfg is not None and not isinstance(cfg, dict):
        raise bad("output_config must be an object", "output_config")
    fmt, where = (cfg or {}).get("format"), "output_config.format"
    if fmt is None:
        fmt, where = obj.get("output_format"), "output_format"
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad(f"{where}.type must be 'json_schema'", f"{where}.type")
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema must be a JSON schema object", f"{where}.schema")
    out["response_format"] = {"type": "json_schema",
                              "json_schema": {"name": "output", "schema": schema, "strict": True}}


def request(obj: dict[str, Any], model: str) -> tuple[dict[str, Any], bool]:
    """(OpenAI chat body, stream) for a Messages body."""
    max_tokens = integer(obj, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise bad("max_tokens: field required (an integer >= 1)", "max_tokens")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages: at least one message is required", "messages")
    out_msgs: list[dict[str, Any]] = []
    system = obj.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out_msgs.append({"role": "system", "content": text})
    for i, m in enumerate(msgs):
        out_msgs.extend(_turn(m, i))
    out: dict[str, Any] = {"model": model, "messages": out_msgs, "max_tokens": max_tokens}
    copy_sampling(obj, out)
    top_k = integer(obj, "top_k")
    if top_k is not None:
        out["top_k"] = top_k
    stop = stop_list(obj.get("stop_sequences"), "stop_sequences")
    if stop:
        out["stop"] = stop
    _tools(obj, out)
    _output_format(obj, out)
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out, stream


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + enc.encode(data) + b"\n\n"


class MessagesConverter(EventsConverter):
    """An engine's chat-completions answer as an Anthropic message (or its event stream)."""

    def __init__(self, model: str, stream: bool, stops: list[str] | None = None,
                 prompt: int = 0) -> None:
        self.model = model
        self.stream = stream
        self.stops = stops or []  # the request's stop_sequences
        self._matched: str | None = None  # the one that ended the text
        self._watch = StopWatch(self.stops) if self.stops else None  # matched by the hub
        self.finished = False  # the text ended on a stop sequence: read no more (streamed)
        self.content_type = b"text/event-stream" if stream else b"application/json"
        self.id = new_id("msg_")
        self._buf = Whole()
        self._sse = SSEReader()
        self._started = False
        self._block: int | None = None  # index of the open content block
        self._kind = ""  # "text" or "tool:<openai index>"
        self._next = 0
        self._finish = "stop"
        self._tally = Tally(prompt)
        self._done = False

    def _stop_word(self, obj: dict[str, Any], ch: dict[str, Any]) -> None:
        """Remember the stop sequence the engine names, if it is one the request gave."""
        for where in (ch, obj):
            for k in ("stop_reason", "stopping_word", "stop_word"):
                v = where.get(k)
                if isinstance(v, str) and v in self.stops:
                    self._matched = v
                    return

    def _stop(self, finish: str) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for an OpenAI finish_reason."""
        if finish == "stop" and self._matched is not None:
            return "stop_sequence", self._matched
        return _STOP.get(finish, "end_turn"), None

    def _message(self, content: list[Any], stop: str | None, usage: Usage,
                 seq: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content,
                "stop_reason": stop, "stop_sequence": seq, "usage": usage_block(usage)}

    # --- whole -----------------------------------------------------------------------

    def _whole(self) -> bytes:
        obj = engine_object(self._buf.take())
        choices = obj.get("choices") or [{}]
        ch = choices[0] if isinstance(choices[0], dict) else {}
        msg: Any = ch.get("message") if isinstance(ch.get("message"), dict) else {}
        content: list[dict[str, Any]] = []
        text = msg.get("content") if isinstance(msg.get("content"), str) else ""
        if self._watch is not None:  # cut at the first stop sequence, which is named
            text = self._watch.feed(text) + self._watch.flush()
            self._matched = self._watch.matched or self._matched
        if text:
            content.append({"type": "text", "text": text})
        for c in msg.get("tool_calls") or []:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            content.append({"type": "tool_use", "id": c.get("id") or new_id("toolu_"),
                            "name": fn.get("name", ""), "input": parse_args(fn.get("arguments"))})
        finish = ch.get("finish_reason") or "stop"
        self._stop_word(obj, ch)
        if self._watch is not None and self._watch.matched is not None:
            finish = "stop"
        stop, seq = self._stop(finish if isinstance(finish, str) else "stop")
        if any(b["type"] == "tool_use" for b in content):
            stop, seq = "tool_use", None
        self._tally.see_whole(obj)
        return enc.encode(self._message(content, stop, self._tally.usage(), seq))

    # --- stream ----------------------------------------------------------------------

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self._block, self._kind = self._next, kind
        self._next += 1
        out.append(_sse("content_block_start", {"type": "content_block_start", "index": self._block,
                                                "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self._block is None:
            return []
        idx, self._block = self._block, None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": idx})]

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        # The prompt's count is known only at the end (message_delta says it again, and
        # the SDKs take that one); until then the hub's estimate, never a 0.
        first = Usage(max(1, self._tally.prompt), 0, 0, estimated=True)
        return [_sse("message_start", {"type": "message_start",
                                       "message": self._message([], None, first)}),
                _sse("ping", {"type": "ping"})]

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if self.finished:
            return out  # past the stop sequence: what the engine made before it closed
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return out
        ch = choices[0]
        if isinstance(ch.get("finish_reason"), str):
            self._finish = ch["finish_reason"]
            self._stop_word(obj, ch)
        delta: Any = ch.get("delta") if isinstance(ch.get("delta"), dict) else {}
        text = delta.get("content")
        if isinstance(text, str) and text and self._watch is not None:
            text = self._watch.feed(text)
            if self._watch.matched is not None:
                self._matched, self._finish, self.finished = self._watch.matched, "stop", True
        out += self._text(text)
        for d in delta.get("tool_calls") or []:
            if not isinstance(d, dict):
                continue
            kind = f"tool:{d.get('index', 0)}"
            fn: Any = d.get("function") if isinstance(d.get("function"), dict) else {}
            if self._kind != kind or self._block is None:
                self._finish = "tool_calls"
                out += self._open(kind, {"type": "tool_use", "id": d.get("id")
                                         or new_id("toolu_"),
                                         "name": fn.get("name") or "", "input": {}})
            piece = fn.get("arguments")
            if isinstance(piece, str) and piece:
                out.append(_sse("content_block_delta", {"type": "content_block_delta",
                                                        "index": self._block,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": piece}}))
        return out

    def _text(self, text: Any) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(text, str) and text:
            if self._kind != "text" or self._block is None:
                out += self._open("text", {"type": "text", "text": ""})
            out.append(_sse("content_block_delta", {"type": "content_block_delta",
                                                    "index": self._block,
                                                    "delta": {"type": "text_delta", "text": text}}))
        return out

    def _finish_events(self) -> list[bytes]:
        if self._done:
            return []
        self._done = True
        held = self._watch.flush() if self._watch is not None else ""
        out = self._start() + self._text(held) + self._close()
        stop, seq = self._stop(self._finish)
        out.append(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop, "stop_sequence": seq},
                                          "usage": usage_block(self._tally.usage())}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return out


def count_request(obj: dict[str, Any], model: str) -> dict[str, Any]:
    """`/v1/messages/count_tokens`: the same conversation asked for one token, so the engine
    counts the prompt itself (its usage.prompt_tokens) with its own tokenizer and template."""
    req, _ = request({**obj, "max_tokens": 1, "stream": False}, model)
    return req


class CountConverter(Buffered):
    """An engine's one-token answer as `{"input_tokens": N}` (the hub's estimate where the
    engine counts none)."""

    def __init__(self, prompt: int = 0) -> None:
        self.prompt = prompt

    def _answer(self, obj: dict[str, Any]) -> bytes:
        t = Tally(self.prompt)
        t.see_whole(obj)
        return enc.encode({"input_tokens": t.usage().input})


def usage_block(u: Usage) -> dict[str, int]:
    """Anthropic's usage: `input_tokens` are the prompt's tokens not read from the cache,
    `cache_read_input_tokens` those that were."""
    out = {"input_tokens": max(0, u.input - u.cached), "output_tokens": u.output}
    if u.cached:
        out["cache_read_input_tokens"] = u.cached
    return out
