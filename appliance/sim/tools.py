"""The simulated engine's tool calls: enough of a model to let clients test tools.

Theory of operation: a chat request that offers tools (and does not say `tool_choice:
"none"`) and whose last message is the user's gets one call of the first tool offered
(or the one `tool_choice` names), with arguments made from the tool's JSON schema: every
required property gets a fixed value of its type. Once a tool's result is in the
conversation the last message is no longer the user's, and the sim answers with text as
usual, so a client's whole tool round trip runs against it. Pure functions; `sim.py`
sends what they build.
"""

from __future__ import annotations

import time
from typing import Any

from appliance.http.lines import LineEncoder

_enc = LineEncoder()  # lines escaped: appliance/http/lines.py
# The value each JSON-schema type gets in a simulated call.
_VALUES = {"string": "sim", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}


def _fn(tool: Any) -> dict[str, Any] | None:
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function", tool)
    return fn if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def pick(tools: Any, tool_choice: Any, last_role: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of the call to make, or None to answer with text."""
    if not isinstance(tools, list) or not tools or last_role != "user" or tool_choice == "none":
        return None
    fns = [f for f in map(_fn, tools) if f is not None]
    if not fns:
        return None
    fn = fns[0]
    if isinstance(tool_choice, dict):
        want = (tool_choice.get("function")
                or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        fn = next((f for f in fns if f["name"] == want), fn)
    params: Any = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props: Any = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required: Any = params.get("required") if isinstance(params.get("required"), list) else []
    args = {k: _VALUES.get((props.get(k) or {}).get("type", "string"), "sim") for k in required
            if isinstance(k, str)}
    return fn["name"], args


def openai_answer(model: str, ident: int, call: tuple[str, dict[str, Any]], stream: bool,
                  include_usage: bool) -> bytes:
    name, args = call
    meta = {"id": f"chatcmpl-sim{ident}", "created": int(time.time()), "model": model,
            "system_fingerprint": "appliance-sim"}
    tc: dict[str, Any] = {"id": f"call_sim{ident}", "type": "function",
          "function": {"name": name, "arguments": _enc.encode(args).decode()}}
    usage = {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}
    if not stream:
        return _enc.encode({**meta, "object": "chat.completion", "choices": [{
            "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [tc]},
            "logprobs": None, "finish_reason": "tool_calls"}], "usage": usage})
    chunk = {**meta, "object": "chat.completion.chunk"}

    def ev(delta: dict[str, Any], finish: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return b"data: " + _enc.encode({**chunk, "choices": [choice]}) + b"\n\n"
    first = {**tc, "index": 0, "function": {"name": name, "arguments": ""}}
    out = [ev({"role": "assistant", "content": None, "tool_calls": [first]}, None),
           ev({"tool_calls": [{"index": 0,
                               "function": {"arguments": tc["function"]["arguments"]}}]}, None),
           ev({}, "tool_calls")]
    if include_usage:
        out.append(b"data: " + _enc.encode({**chunk, "choices": [], "usage": usage}) + b"\n\n")
    return b"".join(out) + b"data: [DONE]\n\n"


def ollama_answer(model: str, created_at: str, call: tuple[str, dict[str, Any]],
                  stream: bool) -> bytes:
    name, args = call
    msg = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": name,
                                                                            "arguments": args}}]}
    last = {"model": model, "created_at": created_at, "message": msg, "done": True,
            "done_reason": "stop",
            "total_duration": 0, "load_duration": 0, "prompt_eval_count": 8,
            "prompt_eval_duration": 0,
            "eval_count": 8, "eval_duration": 0, "x_simulated": True}
    if not stream:
        return _enc.encode(last)
    first = {"model": model, "created_at": created_at, "message": msg, "done": False}
    done = {**last, "message": {"role": "assistant", "content": ""}}
    return _enc.encode(first) + b"\n" + _enc.encode(done) + b"\n"
