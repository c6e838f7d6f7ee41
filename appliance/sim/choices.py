"""The sim's OpenAI answers with several choices or log probabilities: `n`, a list of
prompts on /v1/completions, `logprobs` / `top_logprobs`.

Theory of operation: the common answer (one choice, no log probabilities) goes through
server.py's prebuilt frames, one bytes join per token. What clients test next -- `n`
choices, a batch of prompts, log probabilities -- comes here: each choice is a seed of
its own (the prompt and its index), answered like any other (words, or JSON when asked,
cut at a stop sequence) and framed as OpenAI does: choices indexed prompt-major
(`index = prompt * n + j`), a stream's chunks interleaved per token position, one usage
for all. Building the bodies is pure; `send_choices` paces and sends them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from appliance.http.asgi import JSON_HEADERS, Receive, Send
from appliance.http.errors import ApiError
from appliance.http.lines import LineEncoder
from appliance.http.stream import cancel_on_disconnect
from appliance.sim import shape
from appliance.sim.core import (
    FINGERPRINT,
    SIM_HEADER,
    SSE,
    Req,
    SimModelState,
    SimState,
    count,
    cut_at_stop,
    stops_of,
    tokens,
)

_enc = LineEncoder()  # lines escaped: appliance/http/lines.py
# Choices one request may ask for: OpenAI caps `n` at 128; prompts times n likewise.
MAX_CHOICES = 128


@dataclass
class Choice:
    index: int
    toks: list[str]
    finish: str
    stop_word: str | None


def prompts_of(req: Req) -> list[str] | None:
    """The prompts of a /v1/completions body: a string, a list of strings, or one prompt
    of token ids (a list of ints); None when it is none of these."""
    p = req.prompt
    if p is None or isinstance(p, str):
        return [p or ""]
    if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        return [_enc.encode(p).decode()]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        return [_enc.encode(x).decode() for x in p]
    return None


def wants_choices(req: Req, chat: bool) -> bool:
    """More than the common answer: n > 1, log probabilities, or several prompts."""
    many = not chat and isinstance(req.prompt, list) and bool(req.prompt) and not all(
        isinstance(x, int) for x in req.prompt) and len(req.prompt) > 1
    return (req.n or 1) > 1 or bool(req.logprobs) or many


def build(req: Req, seeds: list[bytes]) -> list[Choice]:
    """One choice per (seed, j < n), indexed prompt-major."""
    n_words, finish = count(req)
    json_on, schema = shape.wanted_schema(req.response_format, req.format)
    out = []
    for p, seed in enumerate(seeds):
        for j in range(req.n or 1):
            own = seed + b"/%d" % j
            if json_on:
                words = "".join(t for t, _ in tokens(own, 4))
                toks = shape.pieces(shape.json_text(schema, words))
                out.append(Choice(p * (req.n or 1) + j, [t for t, _ in toks], "stop", None))
                continue
            toks, stop_word = cut_at_stop(tokens(own, n_words), stops_of(req))
            out.append(Choice(p * (req.n or 1) + j, [t for t, _ in toks],
                              "stop" if stop_word is not None else finish, stop_word))
    return out


def _top(req: Req) -> int:
    if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool):
        return req.logprobs  # /v1/completions: logprobs is the number of alternatives
    return req.top_logprobs or 0


def _logprobs(req: Req, chat: bool, toks: list[str], offset: int = 0) -> Any:
    if not req.logprobs:
        return None
    if chat:
        return shape.chat_logprobs(toks, _top(req))
    return shape.completion_logprobs(toks, _top(req), offset)


def _usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    done = sum(len(c.toks) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done,
            "total_tokens": prompt_tokens + done}


def whole(req: Req, chat: bool, meta: dict[str, Any], choices: list[Choice],
          prompt_tokens: int) -> dict[str, Any]:
    """The non-streamed answer."""
    out = []
    for c in choices:
        text = "".join(c.toks)
        item: dict[str, Any] = {"index": c.index}
        if chat:
            item["message"] = {"role": "assistant", "content": text}
        else:
            item["text"] = text
        item.update(logprobs=_logprobs(req, chat, c.toks), finish_reason=c.finish)
        if c.stop_word:
            item["stop_reason"] = c.stop_word
        out.append(item)
    obj = "chat.completion" if chat else "text_completion"
    return {**meta, "object": obj, "choices": out, "usage": _usage(prompt_tokens, choices)}


def chunks(req: Req, chat: bool, meta: dict[str, Any], choices: list[Choice],
           prompt_tokens: int, include_usage: bool) -> list[list[bytes]]:
    """The stream: per token position, one chunk per choice that still has a token; then
    each choice's finish, the usage when asked, and [DONE]. Position 0 is the role chunk."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def ev(choice: dict[str, Any]) -> bytes:
        return b"data: " + _enc.encode({**meta, "object": obj, "choices": [choice]}) + b"\n\n"

    steps: list[list[bytes]] = []
    if chat:
        steps.append([ev({"index": c.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}) for c in choices])
    longest = max((len(c.toks) for c in choices), default=0)
    offsets = {c.index: 0 for c in choices}
    for i in range(longest):
        step = []
        for c in choices:
            if i >= len(c.toks):
                continue
            t = c.toks[i]
            part: dict[str, Any] = ({"delta": {"content": t}} if chat else {"text": t})
            step.append(ev({"index": c.index, **part,
                            "logprobs": _logprobs(req, chat, [t], offsets[c.index]),
                            "finish_reason": None}))
            offsets[c.index] += len(t)
        steps.append(step)
    last = []
    for c in choices:
        end: dict[str, Any] = {"index": c.index, **({"delta": {}} if chat else {"text": ""}),
                               "logprobs": None, "finish_reason": c.finish}
        if c.stop_word:
            end["stop_reason"] = c.stop_word
        last.append(ev(end))
    if include_usage:
        last.append(b"data: " + _enc.encode({**meta, "object": obj, "choices": [],
                                             "usage": _usage(prompt_tokens, choices)}) + b"\n\n")
    last.append(b"data: [DONE]\n\n")
    steps.append(last)
    return steps


def meta_of(model: str, chat: bool, ident: int) -> dict[str, Any]:
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-sim{ident}", "created": int(time.time()),
            "model": model, "system_fingerprint": FINGERPRINT}


async def send_steps(send: Send, headers: list[tuple[bytes, bytes]], steps: list[list[bytes]],
                     tps: float) -> None:
    """Send a stream's steps, token position i at start + i/tps (0: as fast as it goes)."""
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    start = trio.current_time()
    for i, step in enumerate(steps):
        if tps > 0 and 0 < i < len(steps) - 1:
            await trio.sleep_until(start + i / tps)
        await send({"type": "http.response.body", "body": b"".join(step),
                    "more_body": i < len(steps) - 1})


def has_images(req: Req) -> bool:
    """Images in a body: Ollama's `images` (a message's or /api/generate's), OpenAI's
    `image_url` content parts."""
    if req.images:
        return True
    for msg in req.messages or []:
        if msg.images:
            return True
        if isinstance(msg.content, list) and any(
                isinstance(p, dict) and p.get("type") in ("image_url", "input_image", "image")
                for p in msg.content):
            return True
    return False


def check(caps: list[str], name: str, req: Req) -> None:
    """Refuse what the model cannot do, as engines do: images without vision, thinking
    without it; and the bounds of n and top_logprobs."""
    if "vision" not in caps and has_images(req):
        raise ApiError(400, "invalid_request", f"model {name!r} does not support image input")
    if req.think not in (None, False) and "thinking" not in caps:
        raise ApiError(400, "invalid_request", f'"{name}" does not support thinking')
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise ApiError(400, "invalid_request", f"n must be 1..{MAX_CHOICES}")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= shape.MAX_TOP:
        raise ApiError(400, "invalid_request", f"top_logprobs must be 0..{shape.MAX_TOP}")


async def answer(state: SimState, receive: Receive, send: Send, m: SimModelState, req: Req,
                 chat: bool) -> None:
    """n choices, a batch of prompts, log probabilities: loaded, in a slot, paced."""
    enc = msgspec.json.Encoder()
    if chat:
        seeds = [enc.encode([m.spec.name, req.messages])]
    else:
        prompts = prompts_of(req)
        if prompts is None:
            raise ApiError(400, "invalid_request",
                           "'prompt' must be a string, a list of strings or of token ids")
        seeds = [enc.encode([m.spec.name, ["", p]]) for p in prompts]
    if len(seeds) * (req.n or 1) > MAX_CHOICES:
        raise ApiError(400, "invalid_request",
                       f"at most {MAX_CHOICES} choices (prompts x n) per request")
    await state.ensure_loaded(m)
    built = build(req, seeds)
    meta = meta_of(req.model, chat, state.next_id())
    prompt_tokens = sum(max(1, len(s) // 4) for s in seeds)
    usage = req.stream_options is not None and req.stream_options.include_usage
    async with cancel_on_disconnect(receive), m.slots:
        if req.stream:
            await send_steps(send, SSE, chunks(req, chat, meta, built, prompt_tokens, usage),
                             state.tokens_per_second)
        else:
            body = _enc.encode(whole(req, chat, meta, built, prompt_tokens))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [*JSON_HEADERS, SIM_HEADER,
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
