"""Which API a request speaks, which the chosen engine speaks, and the bytes between them.

Theory of operation: `prepare(path, body, model)` runs once per request, before any node
is picked: it checks the body (a 400 in the client's shape, with `param`, instead of an
engine's 500) and builds the chat-completions body a translation would send. Then, per
node tried, `prepared.for_engine(kind)` answers a `Plan`: the path and body to send and,
when the answer needs translating, a converter (`feed(chunk) -> bytes`, `end() -> bytes`,
`content_type`) -- sync and pure, so tests call them with bytes.

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
    check_openai_chat,
    check_openai_completion,
    check_openai_embedding,
    decode_object,
    enc,
)
from appliance.hub.translate.errors import ErrorConverter
from appliance.hub.translate.usage import Usage, meter, prompt_estimate
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
    """What to send to one node and how to read its answer; `convert` None: pass through.
    An answer of status 400 or more is never passed through: it becomes the hub's own error
    in the client's shape (translate/errors.py), whatever the engine wrote."""

    __slots__ = ("path", "body", "convert", "api", "prompt", "drop_usage", "whole")

    def __init__(self, path: str, body: bytes, api: str, convert: Make | None = None,
                 prompt: int = 0, drop_usage: bool = False, whole: bool = False) -> None:
        self.path = path
        self.body = body
        self.api = api
        self.convert = convert
        self.prompt = prompt  # the prompt's estimate in tokens (translate/usage.py)
        self.drop_usage = drop_usage  # the hub asked for the stream's usage, the client not
        # The engine's stream is only assembled here: the node may send it in one body
        # (wire.WHOLE_HEADER, node/whole.py).
        self.whole = whole

    def converter(self, status: int, content_type: str = "",
                  start: Start | None = None) -> Converter:
        """How to read an answer of `status` and `content_type`: an error converter, the
        translation, or (passed through) a meter."""
        if status >= 400 or (self.convert is not None and status != 200):
            return ErrorConverter(self.api, status)
        if self.convert is None:
            return meter(self.api, content_type, self.prompt, self.drop_usage)
        return self.convert(start or Start(0, 0))


class Prepared:
    __slots__ = ("path", "api", "body", "translated", "make", "always", "refused", "load_only",
                 "need", "prompt", "drop_usage", "assembled", "whole")

    def __init__(self, path: str, api: str, body: bytes, translated: tuple[str,
                                                                           bytes] | None = None,
                 make: Make | None = None, always: bool = False,
                 refused: ApiError | None = None, prompt: int = 0) -> None:
        self.prompt = prompt  # the prompt's estimate in tokens, for an engine that counts none
        self.drop_usage = False  # include_usage was added by the hub
        # Passed through, one answer asked for: the streamed body the engine is sent (its
        # answer gathered by translate/assemble.py), else None.
        self.assembled: bytes | None = None
        # Translated, one answer asked for: the engine's stream is only assembled (no stop
        # sequence of the hub's ends it early), so the node may send it whole.
        self.whole = False
        self.refused = refused  # what an OpenAI-only engine cannot be given (raised for those only)
        self.load_only = False  # Ollama's load/unload request: no prompt, no messages
        self.need = 0  # the fewest context tokens a translated Ollama request takes
        self.path = path
        self.api = api
        self.body = body  # the client's bytes (its model name resolved)
        self.translated = translated  # (path, body) in chat completions / embeddings
        self.make = make
        self.always = always  # translate for every engine kind, not only OPENAI_ONLY

    def for_engine(self, kind: str, context: int = 0) -> Plan:
        """The plan for an engine of `kind` whose context for the model is `context` tokens
        (0: unknown)."""
        if self.refused is not None and (self.always or kind in OPENAI_ONLY):
            raise self.refused
        if self.translated is None or not (self.always or kind in OPENAI_ONLY):
            if self.assembled is not None:
                chat, prompt = self.path == CHAT, self.prompt
                return Plan(self.path, self.assembled, self.api,
                            lambda start: Assembler(prompt, chat), prompt, whole=True)
            return Plan(self.path, self.body, self.api, prompt=self.prompt,
                        drop_usage=self.drop_usage)
        if context and self.need > context:
            raise ollama.too_long(self.need, context)
        path, body = self.translated
        return Plan(path, body, self.api, self.make, self.prompt, whole=self.whole)


def _openai_check(check: Callable[[dict[str, Any]], None],
                  required: str) -> Callable[[dict[str, Any]], ApiError | None]:
    """Wrong types are a 400 at once, whatever the engine; a missing `required` field only
    for OpenAI-only engines (llama.cpp answers a chat without messages with a 200, the
    sim and Ollama with their own error)."""
    def run(obj: dict[str, Any]) -> ApiError | None:
        if obj.get(required) is None:
            return bad(f"'{required}' is required", required)
        check(obj)
        return None
    return run


_OPENAI_CHECKS = {CHAT: _openai_check(check_openai_chat, "messages"),
                  "/v1/completions": _openai_check(check_openai_completion, "prompt"),
                  EMBEDDINGS: _openai_check(check_openai_embedding, "input")}


def _with_model(body: bytes, obj: dict[str, Any], given: str, model: str) -> bytes:
    if given == model:
        return body
    return enc.encode({**obj, "model": model})


# The OpenAI routes whose streams carry a usage chunk when asked (`stream_options`).
_USAGE_STREAMS = frozenset({CHAT, "/v1/completions"})


def _asks_usage(obj: dict[str, Any]) -> bool:
    so = obj.get("stream_options")
    return isinstance(so, dict) and so.get("include_usage") is True


def _with_usage(obj: dict[str, Any], model: str) -> bytes:
    """The body with the stream's usage asked for (the client's other stream options kept)."""
    so = obj.get("stream_options")
    return enc.encode({**obj, "model": model,
                       "stream_options": {**(so if isinstance(so, dict) else {}),
                                          "include_usage": True}})


def prepare(path: str, api: str, body: bytes, given: str, model: str,
            obj: dict[str, Any] | None = None) -> Prepared:
    """Check and translate once; `given` is the body's model name, `model` the resolved one;
    `obj` the body already decoded (a JSON object), else it is decoded here."""
    if obj is None:
        obj = decode_object(body)
    fwd = _with_model(body, obj, given, model)
    if path in _OPENAI_CHECKS:
        refused = _OPENAI_CHECKS[path](obj)
        ask = path in _USAGE_STREAMS and obj.get("stream") is True and not _asks_usage(obj)
        prep = Prepared(path, api, _with_usage(obj, model) if ask else fwd, refused=refused,
                        prompt=prompt_estimate(body))
        prep.drop_usage = ask
        if path in _USAGE_STREAMS and obj.get("stream") is not True:
            # One answer asked for: the engine streams it (a client that leaves closes
            # the stream, which frees the engine's slot) and the hub assembles it.
            prep.assembled = enc.encode(streamed({**obj, "model": model}))
        return prep
    try:
        return _translated(path, api, obj, fwd, given, model)
    except ApiError as e:
        if path.startswith("/api/"):
            # An engine that speaks Ollama natively judges the body itself (a bare
            # `/api/embed` may be its own business); only a translation needs it whole.
            return Prepared(path, api, fwd, refused=e, prompt=prompt_estimate(body))
        raise


def _translated(path: str, api: str, obj: dict[str, Any], fwd: bytes, given: str,
                model: str) -> Prepared:
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
        prep = Prepared(path, api, fwd, (CHAT, enc.encode(req)),
                        lambda start: ollama.ChatConverter(given, stream, chat, start,
                                                           load_only=load_only, prompt=prompt),
                        prompt=prompt)
        prep.load_only = load_only
        prep.need = 0 if load_only else ollama.context_floor(req)
        return prep
    if path in ("/api/embed", "/api/embeddings"):
        legacy = path == "/api/embeddings"
        req = ollama.embed_request(obj, model, legacy)
        return Prepared(path, api, fwd, (EMBEDDINGS, enc.encode(req)),
                        lambda start: ollama.EmbedConverter(given, legacy, start, prompt=prompt),
                        prompt=prompt)
    if path == "/v1/messages":
        req, stream = anthropic.request(obj, model)
        # The hub matches the stop sequences itself, to name the one that ended the text
        # (translate/stops.py): the engine is not given them.
        got = req.pop("stop", None)
        stops = got if isinstance(got, list) else None
        prep = Prepared(path, api, fwd, (CHAT, enc.encode(req if stream else streamed(req))),
                        lambda start: _assembled(stream, prompt, anthropic.MessagesConverter(
                            given, stream, stops, prompt=prompt), stops),
                        always=True, prompt=prompt)
        prep.whole = not stream and not stops
        return prep
    if path == "/v1/messages/count_tokens":
        return Prepared(path, api, fwd, (CHAT, enc.encode(anthropic.count_request(obj, model))),
                        lambda start: anthropic.CountConverter(prompt), always=True,
                        prompt=prompt)
    if path == "/v1/responses":
        req, stream, echo = responses.request(obj, model)
        prep = Prepared(path, api, fwd, (CHAT, enc.encode(req if stream else streamed(req))),
                        lambda start: _assembled(stream, prompt, responses.ResponsesConverter(
                            given, stream, echo, prompt=prompt)),
                        always=True, prompt=prompt)
        prep.whole = not stream
        return prep
    return Prepared(path, api, fwd, prompt=prompt)


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


__all__ = ["OPENAI_ONLY", "Converted", "Plan", "Prepared", "context_length", "decode_object",
           "engine_kind",
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

    __slots__ = ("_body", "_conv", "ended")

    def __init__(self, body: Body, conv: Converter) -> None:
        self._body = body
        self._conv = conv
        self.ended = False

    @property
    def read_timeout(self) -> float:
        return self._body.read_timeout

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
