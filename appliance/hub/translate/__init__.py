"""Which API a request speaks, which the chosen engine speaks, and the bytes between them.

Theory of operation: `prepare(path, body, model)` runs once per request, before any node
is picked: it checks the body (a 400 in the client's shape, with `param`, instead of an
engine's 500) and answers one `Plan`, with the chat-completions plan a translation would
send inside it. Per node tried, `plan.for_engine(kind)` picks one of the two (no new value
per attempt): the path and body to send and, when the answer needs translating, a
converter (`feed(chunk) -> bytes`, `end() -> bytes`, `content_type`) -- sync and pure, so
tests call them with bytes.

Who speaks what (docs/api.md's route table is this function):
- OpenAI chat/completions/embeddings: every engine natively; bytes pass through, read by a
  meter for their token counts (translate/usage.py). A streamed chat or completion asks
  the engine for its usage (`stream_options.include_usage`); the meter drops that chunk
  again when the client did not ask for it.
- Ollama /api/*: `ollama` and `sim` natively; `llamacpp` and `openai` engines get the
  chat-completions / embeddings translation (translate/ollama.py).
- Anthropic /v1/messages and OpenAI /v1/responses: always onto chat completions, the one
  API every engine kind here speaks (translate/anthropic.py, translate/responses.py);
  /v1/messages/count_tokens as a one-token chat whose usage the engine counts.
A generation the client wants as one answer is asked of the engine as a stream and
assembled by the hub (translate/assemble.py): a client that leaves closes the engine's
stream, which frees its slot; the plan says `whole`, and the node sends that stream in one
body (node/whole.py). A name resolved by the hub (`llama3.2` -> `llama3.2:latest`),
the usage asked for or that stream is written into a forwarded body; otherwise a
forwarded body is the client's own bytes. Every
answer's converter ends with the answer's `Usage` (the engine's counts, else the hub's,
marked estimated), which the relay puts on the request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from appliance.http.errors import ApiError
from appliance.hub.translate import anthropic, ollama, responses
from appliance.hub.translate.assemble import Assembler, streamed
from appliance.hub.translate.common import (
    Start,
    bad,
    decode_object,
    enc,
    stop_list,
)
from appliance.hub.translate.errors import ErrorConverter
from appliance.hub.translate.usage import (
    JSONMeter,
    NDJSONMeter,
    SSEMeter,
    Usage,
    prompt_estimate,
)
from appliance.wire import NodeState

# Engine kinds that speak only OpenAI's API (DESIGN 6); the others speak Ollama's too.
OPENAI_ONLY = frozenset({"llamacpp", "openai"})
CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
# Ollama's name for "no tag": a request for `name` may mean `name:latest` and back.
LATEST = ":latest"


class Converter(Protocol):
    content_type: bytes

    def feed(self, chunk: bytes) -> bytes: ...

    def end(self) -> bytes: ...

    def usage(self) -> Usage | None: ...


Make = Callable[[Start], Converter]


class Plan:
    """What to send to a node and how to read its answer; `convert` None: pass through, read
    by a meter. `prepare` makes one per request: the plan for an engine that speaks the
    client's API and, where the request has one, `translated`, the plan for an engine that
    needs the translation; `for_engine` picks one of the two per node tried. An answer of
    status 400 or more is never passed through: it becomes the hub's own error in the
    client's shape (translate/errors.py), whatever the engine wrote."""

    __slots__ = ("path", "body", "api", "convert", "prompt", "drop_usage", "whole",
                 "translated", "always", "refused", "load_only", "need")

    def __init__(self, path: str, body: bytes, api: str, convert: Make | None = None,
                 prompt: int = 0, drop_usage: bool = False, whole: bool = False,
                 translated: Plan | None = None, always: bool = False,
                 refused: ApiError | None = None) -> None:
        self.path = path
        self.body = body  # the client's bytes (its model name resolved), or what a plan sends
        self.api = api
        self.convert = convert
        self.prompt = prompt  # the prompt's estimate in tokens, for an engine that counts none
        self.drop_usage = drop_usage  # the hub asked for the stream's usage, the client not
        # The engine's stream is only assembled here (no stop sequence of the hub's ends it
        # early): the node may send it in one body (wire.WHOLE_HEADER, node/whole.py).
        self.whole = whole
        self.translated = translated  # in chat completions / embeddings
        self.always = always  # translate for every engine kind, not only OPENAI_ONLY
        self.refused = refused  # what an OpenAI-only engine cannot be given (raised for those)
        self.load_only = False  # Ollama's load/unload request: no prompt, no messages
        self.need = 0  # the fewest context tokens a translated Ollama request takes

    def for_engine(self, kind: str, context: int = 0) -> Plan:
        """The plan for an engine of `kind` whose context for the model is `context` tokens
        (0: unknown)."""
        translates = self.always or kind in OPENAI_ONLY
        if self.refused is not None and translates:
            raise self.refused
        if self.translated is None or not translates:
            return self
        if context and self.need > context:
            raise ollama.too_long(self.need, context)
        return self.translated

    def converter(self, status: int, content_type: str = "",
                  start: Start | None = None) -> Converter:
        """How to read an answer of `status` and `content_type`: an error converter, the
        translation, or (passed through) the meter for its content type; `drop_usage`:
        the hub asked for the usage chunk, the client did not (translate/usage.py)."""
        if status >= 400 or (self.convert is not None and status != 200):
            return ErrorConverter(self.api, status)
        if self.convert is not None:
            return self.convert(start or Start(0, 0))
        if "event-stream" in content_type:
            return SSEMeter(self.prompt, self.drop_usage)
        if "ndjson" in content_type:
            return NDJSONMeter(self.prompt)
        return JSONMeter(self.prompt, self.api)


# --- the checks a forwarded (not translated) OpenAI body gets ----------------------------


def check_openai_chat(obj: dict[str, Any]) -> None:
    """What an engine answers with a 500 (llama.cpp on `messages: "x"`, `temperature:
    "hot"`) or, worse, a 200: a 400 naming the field instead."""
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}]")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise bad(f"'messages[{i}].content' must be a string or an array",
                      f"messages[{i}].content")
    check_sampling(obj)


# The OpenAI fields a forwarded body's types are checked for: (field, types, the 400's word).
NUMBER: tuple[type, ...] = (int, float)
SAMPLING_TYPES: tuple[tuple[str, tuple[type, ...], str], ...] = (
    *((k, NUMBER, "a number") for k in ("temperature", "top_p", "frequency_penalty",
                                        "presence_penalty")),
    *((k, (int,), "an integer") for k in ("max_tokens", "max_completion_tokens", "n", "seed")),
    ("stream", (bool,), "a boolean"))


def check_sampling(obj: dict[str, Any]) -> None:
    """`common.opt`'s rule over SAMPLING_TYPES in one pass: absent or None passes, a bool is
    a number or an integer only where bool is named."""
    for k, types, what in SAMPLING_TYPES:
        v = obj.get(k)
        if v is not None and (not isinstance(v, types) or (
                isinstance(v, bool) and bool not in types)):
            raise bad(f"'{k}' must be {what}", k)
    stop = obj.get("stop")
    if stop is not None:
        stop_list(stop, "stop")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad("'tools' must be an array", "tools")


def check_openai_completion(obj: dict[str, Any]) -> None:
    p = obj.get("prompt")
    if not isinstance(p, (str, list)):
        raise bad("'prompt' must be a string or an array", "prompt")
    check_sampling(obj)


def check_openai_embedding(obj: dict[str, Any]) -> None:
    x = obj.get("input")
    if not isinstance(x, (str, list)) or (isinstance(x, list) and not x):
        raise bad("'input' must be a string or a non-empty array", "input")


# The OpenAI routes checked before forwarding: the check, and the field an OpenAI-only
# engine needs. Wrong types are a 400 at once, whatever the engine; a missing field only for
# OpenAI-only engines (llama.cpp answers a chat without messages with a 200, the sim and
# Ollama with their own error).
_OPENAI_CHECKS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    CHAT: (check_openai_chat, "messages"),
    "/v1/completions": (check_openai_completion, "prompt"),
    EMBEDDINGS: (check_openai_embedding, "input")}
# The OpenAI routes whose streams carry a usage chunk when asked (`stream_options`).
_USAGE_STREAMS = frozenset({CHAT, "/v1/completions"})


def prepare(path: str, api: str, body: bytes, given: str, model: str,
            obj: dict[str, Any] | None = None) -> Plan:
    """Check and translate once; `given` is the body's model name, `model` the resolved one;
    `obj` the body already decoded (a JSON object), else it is decoded here."""
    if obj is None:
        obj = decode_object(body)
    fwd = body if given == model else enc.encode({**obj, "model": model})
    if path in _OPENAI_CHECKS:
        check, required = _OPENAI_CHECKS[path]
        refused = None
        if obj.get(required) is None:
            refused = bad(f"'{required}' is required", required)
        else:
            check(obj)
        prompt = prompt_estimate(body)
        if path not in _USAGE_STREAMS:
            return Plan(path, fwd, api, prompt=prompt, refused=refused)
        if obj.get("stream") is not True:
            # One answer asked for: the engine streams it (a client that leaves closes
            # the stream, which frees the engine's slot) and the hub assembles it.
            chat = path == CHAT
            return Plan(path, enc.encode(streamed({**obj, "model": model})), api,
                        lambda start: Assembler(prompt, chat), prompt, whole=True,
                        refused=refused)
        so = obj.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage") is True:
            return Plan(path, fwd, api, prompt=prompt, refused=refused)
        # The stream's usage asked for (the client's other stream options kept); its chunk
        # is dropped again on the way back.
        asked = enc.encode({**obj, "model": model,
                            "stream_options": {**(so if isinstance(so, dict) else {}),
                                               "include_usage": True}})
        return Plan(path, asked, api, prompt=prompt, drop_usage=True, refused=refused)
    try:
        return _translated(path, api, obj, fwd, given, model)
    except ApiError as e:
        if path.startswith("/api/"):
            # An engine that speaks Ollama natively judges the body itself (a bare
            # `/api/embed` may be its own business); only a translation needs it whole.
            return Plan(path, fwd, api, refused=e, prompt=prompt_estimate(body))
        raise


def _translated(path: str, api: str, obj: dict[str, Any], fwd: bytes, given: str,
                model: str) -> Plan:
    """The plan for a request only some engines (or none) speak: passed through to those
    that do, translated onto chat completions or embeddings for the others."""
    prompt = prompt_estimate(fwd)
    if path in ("/api/chat", "/api/generate"):
        chat = path == "/api/chat"
        load_only = not (obj.get("messages") if chat else obj.get("prompt"))
        if load_only:
            # Ollama's "load the model" request: one token asked and thrown away.
            req, stream = {"model": model, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 1,
                           "stream": False}, False
        else:
            req, stream = (ollama.chat_request if chat else ollama.generate_request)(obj, model)
        plan = Plan(path, fwd, api, prompt=prompt, translated=Plan(
            CHAT, enc.encode(req), api,
            lambda start: ollama.ChatConverter(given, stream, chat, start, load_only=load_only,
                                               prompt=prompt), prompt))
        plan.load_only = load_only
        plan.need = 0 if load_only else ollama.context_floor(req)
        return plan
    if path in ("/api/embed", "/api/embeddings"):
        legacy = path == "/api/embeddings"
        req = ollama.embed_request(obj, model, legacy)
        return Plan(path, fwd, api, prompt=prompt, translated=Plan(
            EMBEDDINGS, enc.encode(req), api,
            lambda start: ollama.EmbedConverter(given, legacy, start, prompt=prompt), prompt))
    if path == "/v1/messages":
        req, stream = anthropic.request(obj, model)
        # The hub matches the stop sequences itself, to name the one that ended the text
        # (translate/stops.py): the engine is not given them.
        got = req.pop("stop", None)
        stops = got if isinstance(got, list) else None
        return Plan(path, fwd, api, prompt=prompt, always=True, translated=Plan(
            CHAT, enc.encode(req if stream else streamed(req)), api,
            lambda start: _assembled(stream, prompt, anthropic.MessagesConverter(
                given, stream, stops, prompt=prompt), stops),
            prompt, whole=not stream and not stops))
    if path == "/v1/messages/count_tokens":
        return Plan(path, fwd, api, prompt=prompt, always=True, translated=Plan(
            CHAT, enc.encode(anthropic.count_request(obj, model)), api,
            lambda start: anthropic.CountConverter(prompt), prompt))
    if path == "/v1/responses":
        req, stream, echo = responses.request(obj, model)
        return Plan(path, fwd, api, prompt=prompt, always=True, translated=Plan(
            CHAT, enc.encode(req if stream else streamed(req)), api,
            lambda start: _assembled(stream, prompt, responses.ResponsesConverter(
                given, stream, echo, prompt=prompt)), prompt, whole=not stream))
    return Plan(path, fwd, api, prompt=prompt)


def _assembled(stream: bool, prompt: int, conv: Converter,
               stops: list[str] | None = None) -> Converter:
    """A translation's converter; for one answer, behind the assembler of the engine's
    stream (translate/assemble.py), which ends it at a stop sequence of `stops`."""
    return conv if stream else Assembler(prompt, True, conv, stops)


def resolve(name: str, known: Callable[[str], bool]) -> tuple[str, bool]:
    """Ollama's tag rule: `llama3.2` is `llama3.2:latest` and the other way round. The
    model `name` means, and whether it is known (each name tried is asked once)."""
    if known(name):
        return name, True
    if name.endswith(LATEST):
        bare = name[: -len(LATEST)]
        if bare and known(bare):
            return bare, True
    elif ":" not in name.rsplit("/", 1)[-1] and known(name + LATEST):
        return name + LATEST, True
    return name, False


__all__ = ["OPENAI_ONLY", "Converted", "Plan", "context_length", "decode_object", "engine_kind",
           "prepare", "resolve"]


def context_length(state: NodeState | None, model: str) -> int:
    """The context length a node reports for `model` (0: it says none)."""
    m = state.model(model) if state is not None else None
    return m.meta.context_length if m is not None and m.meta is not None else 0


def engine_kind(state: NodeState | None) -> str:
    """The kind of engine a node runs (its first install), "" while it reports none."""
    if state is None or not state.engines:
        return ""
    return state.engines[0].kind


class Body(Protocol):
    """A node's answer as `Converted` reads it (appliance.client.upstream.Response)."""

    read_timeout: float
    waited_at: float

    async def receive(self) -> bytes: ...

    async def timed_out(self) -> Exception: ...


class Converted:
    """A node's answer for appliance/http/stream.py's `relay_body`: its payload through
    `conv` (a translation or a meter; either parses every event); `ended` once the
    converter's last bytes were handed out. Not an async generator: one loop reads it, and
    closing the upstream stays the caller's."""

    __slots__ = ("_body", "_conv", "ended", "read_timeout")

    def __init__(self, body: Body, conv: Converter) -> None:
        self._body = body
        self._conv = conv
        self.ended = False
        self.read_timeout = body.read_timeout  # the body's, fixed when it was asked for

    @property
    def waited_at(self) -> float:
        return self._body.waited_at

    async def timed_out(self) -> Exception:
        return await self._body.timed_out()

    def take_whole(self, data: bytes) -> bytes:
        """The converter's whole output for an answer that came whole with its head."""
        self.ended = True
        return self._conv.feed(data) + self._conv.end()

    async def receive(self) -> bytes:
        """The converter's output for the next reads (b"" once it ended); safe to cancel:
        the node's bytes are fed only once read."""
        while not self.ended:
            chunk = await self._body.receive()
            if not chunk:
                self.ended = True
                return self._conv.end()
            out = self._conv.feed(chunk)
            if getattr(self._conv, "finished", False):
                # The answer ended before the engine's stream (a stop sequence the hub
                # matched, translate/stops.py): its end now; closing the stream is the
                # caller's, which stops the engine.
                self.ended = True
                return out + self._conv.end()
            if out:
                return out
        return b""
