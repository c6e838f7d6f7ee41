"""Which API a request speaks, which the chosen engine speaks, and the bytes between them.

Theory of operation: `prepare(path, body, model)` runs once per request, before any node
is picked: it checks the body (a 400 in the client's shape, with `param`, instead of an
engine's 500) and builds the chat-completions body a translation would send. Then, per
node tried, `prepared.for_engine(kind)` answers a `Plan`: the path and body to send and,
when the answer needs translating, a converter (`feed(chunk) -> bytes`, `end() -> bytes`,
`content_type`) -- sync and pure, so tests call them with bytes.

Who speaks what (the README's route table is this function):
- OpenAI chat/completions/embeddings: every engine natively; bytes pass untouched.
- Ollama /api/*: `ollama` and `sim` natively; `llamacpp` and `openai` engines get the
  chat-completions / embeddings translation (translate/ollama.py).
- Anthropic /v1/messages and OpenAI /v1/responses: always onto chat completions, the one
  API every engine kind here speaks (translate/anthropic.py, translate/responses.py);
  /v1/messages/count_tokens as a one-token chat whose usage the engine counts.
A name resolved by the hub (`llama3.2` -> `llama3.2:latest`) is written into a forwarded
body; otherwise a forwarded body is the client's own bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from appliance.http.errors import ApiError
from appliance.hub.translate import anthropic, ollama, responses
from appliance.hub.translate.common import (
    bad,
    check_openai_chat,
    check_openai_completion,
    check_openai_embedding,
    decode_object,
    enc,
)
from appliance.hub.translate.errors import ErrorConverter
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


class Plan:
    """What to send to one node and how to read its answer; `convert` None: pass through.
    An answer of status 400 or more is never passed through: it becomes the hub's own error
    in the client's shape (translate/errors.py), whatever the engine wrote."""

    __slots__ = ("path", "body", "convert", "api")

    def __init__(self, path: str, body: bytes, api: str,
                 convert: Callable[[], Converter] | None = None) -> None:
        self.path = path
        self.body = body
        self.api = api
        self.convert = convert

    def converter(self, status: int) -> Converter | None:
        if status >= 400:
            return ErrorConverter(self.api, status)
        if self.convert is None:
            return None
        if status != 200:
            return ErrorConverter(self.api, status)
        return self.convert()


class Prepared:
    __slots__ = ("path", "api", "body", "translated", "make", "always", "refused", "load_only",
                 "need")

    def __init__(self, path: str, api: str, body: bytes, translated: tuple[str,
                                                                           bytes] | None = None,
                 make: Callable[[], Converter] | None = None, always: bool = False,
                 refused: ApiError | None = None) -> None:
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
            return Plan(self.path, self.body, self.api)
        if context and self.need > context:
            raise ollama.too_long(self.need, context)
        path, body = self.translated
        return Plan(path, body, self.api, self.make)


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


def prepare(path: str, api: str, body: bytes, given: str, model: str,
            obj: dict[str, Any] | None = None) -> Prepared:
    """Check and translate once; `given` is the body's model name, `model` the resolved one;
    `obj` the body already decoded (a JSON object), else it is decoded here."""
    if obj is None:
        obj = decode_object(body)
    fwd = _with_model(body, obj, given, model)
    if path in _OPENAI_CHECKS:
        return Prepared(path, api, fwd, refused=_OPENAI_CHECKS[path](obj))
    try:
        return _translated(path, api, obj, fwd, given, model)
    except ApiError as e:
        if path.startswith("/api/"):
            # An engine that speaks Ollama natively judges the body itself (a bare
            # `/api/embed` may be its own business); only a translation needs it whole.
            return Prepared(path, api, fwd, refused=e)
        raise


def _translated(path: str, api: str, obj: dict[str, Any], fwd: bytes, given: str,
                model: str) -> Prepared:
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
                        lambda: ollama.ChatConverter(given, stream, chat, load_only=load_only))
        prep.load_only = load_only
        prep.need = 0 if load_only else ollama.context_floor(req)
        return prep
    if path in ("/api/embed", "/api/embeddings"):
        legacy = path == "/api/embeddings"
        req = ollama.embed_request(obj, model, legacy)
        return Prepared(path, api, fwd, (EMBEDDINGS, enc.encode(req)),
                        lambda: ollama.EmbedConverter(given, legacy))
    if path == "/v1/messages":
        req, stream = anthropic.request(obj, model)
        stops = req.get("stop")
        return Prepared(path, api, fwd, (CHAT, enc.encode(req)),
                        lambda: anthropic.MessagesConverter(
                            given, stream, stops if isinstance(stops, list) else None),
                        always=True)
    if path == "/v1/messages/count_tokens":
        return Prepared(path, api, fwd, (CHAT, enc.encode(anthropic.count_request(obj, model))),
                        anthropic.CountConverter, always=True)
    if path == "/v1/responses":
        req, stream, echo = responses.request(obj, model)
        return Prepared(path, api, fwd, (CHAT, enc.encode(req)),
                        lambda: responses.ResponsesConverter(given, stream, echo), always=True)
    return Prepared(path, api, fwd)


def resolve(name: str, known: Callable[[str], bool]) -> str:
    """Ollama's tag rule: `llama3.2` is `llama3.2:latest` and the other way round."""
    if known(name):
        return name
    if name.endswith(LATEST):
        bare = name[: -len(LATEST)]
        if bare and known(bare):
            return bare
    elif ":" not in name.rsplit("/", 1)[-1] and known(name + LATEST):
        return name + LATEST
    return name


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
    """A translated answer for appliance/http/stream.py's `relay_body`: the node's payload
    through `conv` (which parses every event); `ended` once the converter's last bytes
    were handed out. Not an async generator: one loop reads it, and closing the upstream
    stays the caller's."""

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

    async def receive(self) -> bytes:
        """The converter's output for the next reads (b"" once it ended); safe to cancel:
        the node's bytes are fed only once read."""
        while not self.ended:
            chunk = await self._body.receive()
            if not chunk:
                self.ended = True
                return self._conv.end()
            out = self._conv.feed(chunk)
            if out:
                return out
        return b""
