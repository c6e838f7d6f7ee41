"""OpenAI's Responses API (`POST /v1/responses`) onto chat completions.

Theory of operation: this module keeps no conversation state: the hub's store rebuilds a
`previous_response_id` chain or a `conversation` into `input` (hub/api/responses.py,
HUB_FIELDS); without one `previous_response_id` is a 400 that says so. Everything else is
stateless and maps onto one chat-completions body:
`instructions` the system message, `input` a string (one user turn) or a list of items
(messages with input_text/output_text/input_image parts, `function_call` items as the
assistant's tool calls, `function_call_output` items as tool messages), function tools
flattened into chat's nested shape, `max_output_tokens` -> max_tokens, `text.format` ->
response_format. The answer is a `response` object with `message` and `function_call`
output items; streamed, the event sequence the SDK reads: response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta ...,
output_text.done, content_part.done, output_item.done (and function_call_arguments.delta
/ .done for calls), response.completed -- each with its `sequence_number`. An answer the
cap cut (finish_reason `length`) is `incomplete` with `incomplete_details.reason:
max_output_tokens` (its last event `response.incomplete`), as OpenAI's. The usage is the
engine's, else the hub's count (translate/usage.py); ids are random.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from appliance.hub.translate.common import (
    EventsConverter,
    SSEReader,
    ToolCallAccumulator,
    Whole,
    bad,
    copy_sampling,
    enc,
    engine_object,
    integer,
)
from appliance.hub.translate.usage import Tally, Usage

# The finish reason that means the cap cut the answer: the response is `incomplete`.
CUT = "length"


def _part(p: Any, where: str) -> dict[str, Any]:
    t = p.get("type") if isinstance(p, dict) else None
    if t in ("input_text", "output_text", "text") and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    if t == "input_image" and isinstance(p.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": p["image_url"]}}
    raise bad(f"'{where}' must be an input_text, output_text or input_image part", where)


def _items(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"'{where}' must be an object", where)
        t = it.get("type", "message")
        if t == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{where}.role' must be user, assistant, system or developer",
                          f"{where}.role")
            c = it.get("content")
            if isinstance(c, str):
                content: Any = c
            elif isinstance(c, list):
                parts = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(c)]
                content = ("".join(p["text"] for p in parts) if all(p["type"] == "text"
                                                                    for p in parts) else parts)
            else:
                raise bad(f"'{where}.content' must be a string or an array", f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": content})
        elif t == "function_call":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("name"), str):
                raise bad(f"'{where}' function_call needs string call_id and name", where)
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif t == "function_call_output":
            if not isinstance(it.get("call_id"), str):
                raise bad(f"'{where}.call_id' must be a string", f"{where}.call_id")
            o = it.get("output")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": o if isinstance(o, str) else enc.encode(o).decode()})
        elif t == "reasoning":
            continue
        else:
            raise bad(f"'{where}.type' {t!r} is not supported here", f"{where}.type")
    return out


def _text_format(obj: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """`text.format` as chat's `response_format` (the node turns a JSON schema into what
    its engine takes); the format the response echoes."""
    text = obj.get("text")
    if text is not None and not isinstance(text, dict):
        raise bad("'text' must be an object", "text")
    fmt = (text or {}).get("format")
    if fmt is None:
        return {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"type": "text"}
    if kind == "json_object":
        out["response_format"] = {"type": "json_object"}
        return {"type": "json_object"}
    if kind != "json_schema" or not isinstance(fmt, dict):
        raise bad("'text.format.type' must be text, json_object or json_schema",
                  "text.format.type")
    schema, name = fmt.get("schema"), fmt.get("name", "response")
    if not isinstance(schema, dict):
        raise bad("'text.format.schema' must be a JSON schema object", "text.format.schema")
    if not isinstance(name, str):
        raise bad("'text.format.name' must be a string", "text.format.name")
    strict = fmt.get("strict") is True
    out["response_format"] = {"type": "json_schema", "json_schema": {
        "name": name, "schema": schema, "strict": strict}}
    return {"type": "json_schema", "name": name, "schema": schema, "strict": strict}


# Set by the hub's store (hub/api/responses.py) on a body it rebuilt from a chain or a
# conversation: the response's id and the fields a stored response echoes (a client's own
# is dropped there). Without a store, previous_response_id stays a 400.
HUB_FIELDS = "hub_stored"
ECHOED = ("id", "previous_response_id", "store", "background", "conversation")


def request(obj: dict[str, Any], model: str) -> tuple[dict[str, Any], bool, dict[str, Any]]:
    """(OpenAI chat body, stream, the request fields the response object echoes)."""
    stored = obj.get(HUB_FIELDS)
    if obj.get("previous_response_id") is not None and not isinstance(stored, dict):
        raise bad(
            "previous_response_id is not supported: this hub stores no responses; send the whole "
                  "conversation in 'input'", "previous_response_id")
    msgs: list[dict[str, Any]] = []
    instr = obj.get("instructions")
    if instr is not None:
        if not isinstance(instr, str):
            raise bad("'instructions' must be a string", "instructions")
        msgs.append({"role": "system", "content": instr})
    x = obj.get("input")
    if isinstance(x, str):
        msgs.append({"role": "user", "content": x})
    elif isinstance(x, list) and x:
        msgs += _items(x)
    else:
        raise bad("'input' must be a string or a non-empty array of items", "input")
    out: dict[str, Any] = {"model": model, "messages": msgs}
    copy_sampling(obj, out)
    mx = integer(obj, "max_output_tokens")
    if mx is not None:
        out["max_tokens"] = mx
    tools = obj.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be an array", "tools")
        conv = []
        for i, t in enumerate(tools):
            if not isinstance(t,
                              dict) or t.get("type") != "function" or not isinstance(t.get("name"),
                                                                                     str):
                raise bad(
                    f"'tools[{i}]' must be a function tool with a name (only function tools are "
                    "served)",
                          f"tools[{i}]")
            fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            conv.append({"type": "function", "function": fn})
        if conv:
            out["tools"] = conv
    tc = obj.get("tool_choice")
    if tc in ("auto", "none", "required"):
        out["tool_choice"] = tc
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
    fmt = _text_format(obj, out)
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    echo: dict[str, Any] = {
            "instructions": instr, "max_output_tokens": mx, "temperature": out.get("temperature"),
            "top_p": out.get("top_p"), "tools": tools or [], "tool_choice": tc or "auto",
            "text": {"format": fmt},
            "metadata": obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}}
    if isinstance(stored, dict):
        echo.update({k: stored[k] for k in ECHOED if k in stored})
    return out, stream, echo


class ResponsesConverter(EventsConverter):
    """An engine's chat-completions answer as a Responses `response` (or its event stream)."""

    def __init__(self, model: str, stream: bool, echo: dict[str, Any], prompt: int = 0) -> None:
        self.model = model
        self.stream = stream
        self.echo = echo
        self.content_type = b"text/event-stream" if stream else b"application/json"
        # Random: unique across hub restarts and hubs (a counter started again at 1).
        n = secrets.token_hex(24)
        self.id = f"resp_{n}"
        self._msg_id = f"msg_{n}"
        self._tally = Tally(prompt)
        self._finish = "stop"
        self.created = int(time.time())
        self._buf = Whole()
        self._sse = SSEReader()
        self._seq = 0
        self._started = False
        self._text: str | None = None  # None: no message item opened yet
        self._tools = ToolCallAccumulator()
        self._tool_items: dict[int, int] = {}  # engine tool index -> output_index
        self._outputs = 0
        self._done = False

    def _status(self) -> str:
        """`incomplete` when the cap (max_output_tokens) cut the answer, else `completed`."""
        return "incomplete" if self._finish == CUT else "completed"

    def _response(self, status: str, output: list[Any], usage: Usage | None) -> dict[str, Any]:
        r = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
             "model": self.model, "output": output, "parallel_tool_calls": True, "error": None,
             "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                    else None),
             "text": {"format": {"type": "text"}}, **self.echo}
        r["usage"] = None if usage is None else {
            "input_tokens": usage.input, "output_tokens": usage.output,
            "total_tokens": usage.input + usage.output,
            "input_tokens_details": {"cached_tokens": usage.cached},
            "output_tokens_details": {"reasoning_tokens": 0}}
        return r

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [] if status == "in_progress" else [{"type": "output_text", "text": text,
                                                       "annotations": []}]
        return {"type": "message", "id": self._msg_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call['id'] or 'call'}", "call_id": call["id"]
                or "call_0",
                "name": call["name"], "arguments": call["arguments"], "status": status}

    def _ev(self, kind: str, **data: Any) -> bytes:
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + enc.encode(
            {"type": kind, "sequence_number": self._seq - 1, **data}) + b"\n\n"

    # --- whole -----------------------------------------------------------------------

    def _whole(self) -> bytes:
        obj = engine_object(self._buf.take())
        choices = obj.get("choices") or [{}]
        ch = choices[0] if isinstance(choices[0], dict) else {}
        msg: Any = ch.get("message") if isinstance(ch.get("message"), dict) else {}
        if isinstance(ch.get("finish_reason"), str):
            self._finish = ch["finish_reason"]
        status = self._status()
        output = []
        if isinstance(msg.get("content"), str) and msg["content"]:
            output.append(self._message_item(msg["content"], status))
        for c in msg.get("tool_calls") or []:
            fn = c.get("function", {}) if isinstance(c, dict) else {}
            output.append(self._call_item({"id": c.get("id", ""), "name": fn.get("name", ""),
                                           "arguments": fn.get("arguments") or "{}"}, "completed"))
        self._tally.see_whole(obj)
        return enc.encode(self._response(status, output, self._tally.usage()))

    # --- stream ----------------------------------------------------------------------

    def _start(self) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        r = self._response("in_progress", [], None)
        return [self._ev("response.created", response=r), self._ev("response.in_progress",
                                                                   response=r)]

    def _chunk(self, obj: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return out
        if isinstance(choices[0].get("finish_reason"), str):
            self._finish = choices[0]["finish_reason"]
        delta: Any = (choices[0].get("delta")
                                 if isinstance(choices[0].get("delta"), dict) else {})
        text = delta.get("content")
        if isinstance(text, str) and text:
            if self._text is None:
                self._text = ""
                self._msg_index = self._outputs
                self._outputs += 1
                out.append(self._ev("response.output_item.added", output_index=self._msg_index,
                                    item=self._message_item("", "in_progress")))
                out.append(self._ev("response.content_part.added", item_id=self._msg_id,
                                    output_index=self._msg_index,
                                    content_index=0, part={"type": "output_text", "text": "",
                                                           "annotations": []}))
            self._text += text
            out.append(self._ev("response.output_text.delta", item_id=self._msg_id,
                                output_index=self._msg_index,
                                content_index=0, delta=text))
        for idx, call, piece in self._tools.add(delta.get("tool_calls")):
            if idx not in self._tool_items:
                self._tool_items[idx] = self._outputs
                self._outputs += 1
                out.append(self._ev("response.output_item.added",
                                    output_index=self._tool_items[idx],
                                    item=self._call_item({**call, "arguments": ""}, "in_progress")))
            if piece:
                out.append(self._ev("response.function_call_arguments.delta",
                                    item_id=f"fc_{call['id'] or 'call'}",
                                    output_index=self._tool_items[idx], delta=piece))
        return out

    def _finish_events(self) -> list[bytes]:
        if self._done:
            return []
        self._done = True
        out = self._start()
        status = self._status()
        output: list[tuple[int, dict[str, Any]]] = []
        if self._text is not None:
            item = self._message_item(self._text, status)
            part = item["content"][0]
            out.append(self._ev("response.output_text.done", item_id=self._msg_id,
                                output_index=self._msg_index,
                                content_index=0, text=self._text))
            out.append(self._ev("response.content_part.done", item_id=self._msg_id,
                                output_index=self._msg_index,
                                content_index=0, part=part))
            out.append(self._ev("response.output_item.done", output_index=self._msg_index,
                                item=item))
            output.append((self._msg_index, item))
        for idx, call in sorted(self._tools.calls.items()):
            item = self._call_item(call, "completed")
            oi = self._tool_items[idx]
            out.append(self._ev("response.function_call_arguments.done", item_id=item["id"],
                                output_index=oi,
                                arguments=call["arguments"]))
            out.append(self._ev("response.output_item.done", output_index=oi, item=item))
            output.append((oi, item))
        resp = self._response(status, [i for _, i in sorted(output, key=lambda p: p[0])],
                              self._tally.usage())
        # OpenAI ends a cut answer with `response.incomplete`, any other with `.completed`.
        out.append(self._ev(f"response.{status}", response=resp))
        return out
