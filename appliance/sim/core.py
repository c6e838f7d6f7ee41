"""The simulated engine's core: its models, their load state, deterministic output, and
how each API frames an answer.

Theory of operation: `SimState` holds the configured models (`Sim__Models__N__*`, default
one `sim-small` of 500 MiB), whether each is loaded, and one `trio.Semaphore(Sim__Parallel)`
per model that bounds how many requests generate at once. A load takes `LoadSeconds` of
trio time (so `autojump_clock` tests skip it) and, when `FailLoad` is set, then fails with
that text and leaves the model unloaded -- the way an engine fails on an architecture it
does not know. Loaded models stay loaded until unloaded (no keep-alive expiry).

Output is a pure function of a seed (the model and the prompt or messages): `tokens`
picks words with a PRNG seeded by it, `embedding` hashes it. The JSON of every word is
encoded once at import, and a `Frame` builds each request's chunk prefix and suffix once
(Ollama NDJSON, OpenAI SSE), so streaming a token costs one bytes join. No HTTP here;
`appliance.sim.server` is the server around it.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import random
import struct
import time
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from appliance import __version__
from appliance.config import SimConfig, SimModel
from appliance.http.errors import ApiError
from appliance.http.lines import LineEncoder

log = logging.getLogger("appliance.sim.server")

EMBED_DIM = 16
_VOCAB = (
    "the quick brown fox jumps over a lazy dog while seven small engines hum along in "
    "quiet racks of warm metal and every token arrives on time through the long night "
    "as operators sleep because nothing failed today except one model that was parked "
    "with its last error shown clearly for all to read"
).split()
_enc = LineEncoder()  # lines escaped: appliance/http/lines.py
# (text, JSON) of each token: the first word of an answer bare, every later one spaced.
_FIRST = tuple((w, _enc.encode(w)) for w in _VOCAB)
_LATER = tuple((" " + w, _enc.encode(" " + w)) for w in _VOCAB)

VERSION = f"{__version__}-sim"
FINGERPRINT = "appliance-sim"
# Neither API bounds an answer by default; a short fixed one keeps tests and demos quick.
DEFAULT_TOKENS = 16
# The longest answer one request gets: the usual context window of small models.
MAX_TOKENS = 4096
SIM_HEADER = (b"x-appliance-engine", b"sim")
NDJSON = [(b"content-type", b"application/x-ndjson"), SIM_HEADER]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), SIM_HEADER]


class Msg(msgspec.Struct):
    role: str = ""
    content: Any = ""
    images: Any = None  # Ollama's base64 images of a message


class Options(msgspec.Struct):
    num_predict: int | None = None
    stop: str | list[str] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Req(msgspec.Struct):
    """The fields of either API's request bodies the sim reads (others are ignored)."""

    model: str = ""
    name: str = ""  # /api/show's older spelling of `model`
    prompt: Any = None
    system: str = ""
    messages: list[Msg] | None = None
    stream: bool | None = None
    keep_alive: Any = None
    options: Options | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream_options: StreamOptions | None = None
    input: Any = None
    encoding_format: str = "float"
    tools: Any = None
    tool_choice: Any = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # llama.cpp's, vLLM's: enable_thinking
    reasoning_effort: str | None = None
    think: Any = None  # Ollama's: true, false, or "low" | "medium" | "high"
    images: Any = None  # Ollama /api/generate's base64 images
    response_format: Any = None  # OpenAI's: json_object, json_schema
    format: Any = None  # Ollama's: "json" or a JSON schema
    n: int | None = None
    logprobs: Any = None  # chat: a bool (top_logprobs says how many); completions: an int
    top_logprobs: int | None = None


req_decoder = msgspec.json.Decoder(Req)


def tokens(seed: bytes, n: int) -> list[tuple[str, bytes]]:
    """n (text, JSON) tokens, the same for the same seed."""
    if n <= 0:
        return []
    rng = random.Random(seed)
    return [rng.choice(_FIRST), *rng.choices(_LATER, k=n - 1)]


# Reasoning tokens a chat that asks for thinking gets before its answer (OpenAI routes).
THINK_TOKENS = 4


def wants_thinking(req: Req) -> bool:
    """A chat asking to think: `chat_template_kwargs.enable_thinking` true (llama.cpp,
    vLLM), a `reasoning_effort`, or Ollama's `think` (true or a level)."""
    if req.think is not None and req.think is not False:
        return True
    kw = req.chat_template_kwargs or {}
    return kw.get("enable_thinking") is True or (req.reasoning_effort is not None
                                                 and kw.get("enable_thinking") is not False)


def stops_of(req: Req) -> list[str]:
    """The stop sequences a request names (OpenAI's `stop`, Ollama's `options.stop`)."""
    stop = req.stop if req.stop is not None else (req.options.stop if req.options else None)
    if stop is None:
        return []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if s]


def cut_at_stop(toks: list[tuple[str, bytes]],
                stops: list[str]) -> tuple[list[tuple[str, bytes]], str | None]:
    """The tokens before the first stop sequence in their text (a token the sequence
    starts inside is cut to its part before it; the sequence itself is not sent, as
    engines strip it), and the sequence matched (None: no stop)."""
    if not stops:
        return toks, None
    text = "".join(t for t, _ in toks)
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return toks, None
    out: list[tuple[str, bytes]] = []
    pos = 0
    for t, j in toks:
        if pos + len(t) > best[0]:
            part = t[:best[0] - pos]
            if part:
                out.append((part, _enc.encode(part)))
            break
        out.append((t, j))
        pos += len(t)
    return out, best[1]


def embedding(seed: bytes) -> list[float]:
    """A unit vector of EMBED_DIM floats, the same for the same seed."""
    raw = struct.unpack(f"<{EMBED_DIM}I", hashlib.blake2b(seed, digest_size=4 * EMBED_DIM).digest())
    vec = [v / 2147483648.0 - 1.0 for v in raw]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]


def is_zero_keep_alive(keep_alive: Any) -> bool:
    """Ollama's keep_alive: seconds as a number, or a duration string ("0", "0s", "5m")."""
    if isinstance(keep_alive, (int, float)) and not isinstance(keep_alive, bool):
        return keep_alive == 0
    if isinstance(keep_alive, str):
        try:
            return float(keep_alive.strip().rstrip("hms") or "1") == 0
        except ValueError:
            return False
    return False


class SimModelState:
    def __init__(self, spec: SimModel, parallel: int) -> None:
        self.spec = spec
        self.loaded = False
        self.loads = 0  # load attempts, failed ones included
        self.lock = trio.Lock()
        self.slots = trio.Semaphore(parallel)
        self.parallel = parallel
        self.digest = hashlib.sha256(spec.name.encode()).hexdigest()


class SimState:
    """The simulated models and their load state; the one thing the sim's app mutates."""

    def __init__(self, sim_cfg: SimConfig) -> None:
        self.models: dict[str, SimModelState] = {}
        self.started_at = time.time()
        self._ids = 0
        self.reconfigure(sim_cfg)

    def reconfigure(self, sim_cfg: SimConfig) -> None:
        """Take a new Sim config (SIGHUP); a model whose definition is unchanged keeps its state."""
        self.tokens_per_second = sim_cfg.tokens_per_second
        old, self.models = self.models, {}
        for spec in sim_cfg.effective_models():
            m = old.get(spec.name)
            if m is None or m.spec != spec or m.parallel != sim_cfg.parallel:
                fresh = SimModelState(spec, sim_cfg.parallel)
                # Hang toggled alone (a fault switched by SIGHUP) keeps the model loaded.
                same = m is not None and msgspec.structs.replace(m.spec, hang=spec.hang) == spec
                fresh.loaded = same and m is not None and m.loaded
                m = fresh
            self.models[spec.name] = m

    def lookup(self, name: str) -> SimModelState | None:
        """Ollama treats `x` and `x:latest` as one model."""
        m = self.models.get(name)
        if m is None:
            m = self.models.get(name[:-7] if name.endswith(":latest") else name + ":latest")
        return m

    def add(self, name: str) -> SimModelState:
        """`/api/pull`: a model of the default size appears (what a pull leaves behind)."""
        m = self.lookup(name)
        if m is None:
            parallel = next(iter(self.models.values())).parallel if self.models else 4
            m = self.models[name] = SimModelState(SimModel(name=name), parallel)
        return m

    def remove(self, name: str) -> bool:
        """`/api/delete`: the model is gone (False: there was none)."""
        m = self.lookup(name)
        if m is None:
            return False
        del self.models[m.spec.name]
        return True

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def ensure_loaded(self, m: SimModelState) -> None:
        """Load `m` unless it is loaded; ApiError(500) with the FailLoad text on failure."""
        if m.loaded:
            return
        async with m.lock:
            if m.loaded:
                return
            await trio.sleep(m.spec.load_seconds)
            m.loads += 1
            if m.spec.fail_load:
                log.info("sim: load of %s fails as configured: %s", m.spec.name, m.spec.fail_load)
                raise ApiError(500, "model_load_failed", m.spec.fail_load)
            m.loaded = True
            log.info("sim: loaded %s", m.spec.name)

    def unload(self, m: SimModelState) -> None:
        if m.loaded:
            log.info("sim: unloaded %s", m.spec.name)
        m.loaded = False

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Per model: loaded, loads (attempts), generating, waiting (for a slot)."""
        return {
            name: {"loaded": m.loaded, "loads": m.loads, "generating": m.parallel - m.slots.value,
                   "waiting": m.slots.statistics().tasks_waiting}
            for name, m in self.models.items()
        }


# --- how each API frames an answer ----------------------------------------------------


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


class Frame:
    """How one API frames one generation: stream chunks and the whole answer."""

    headers: list[tuple[bytes, bytes]]
    head: bytes = b""
    think_prefix: bytes = b""  # a reasoning token's chunk prefix (OpenAI chat), else none
    prefix: bytes
    suffix: bytes
    tail: Callable[[dict[str, Any]], bytes]  # stats -> the stream's last bytes
    whole: Callable[[str, dict[str, Any]], Any]  # (text, stats) -> the non-streamed answer


def ollama_frame(model: str, chat: bool) -> Frame:
    f = Frame()
    created = iso(time.time())
    start = b'{"model":' + _enc.encode(model) + b',"created_at":' + _enc.encode(created)
    if chat:
        f.prefix = start + b',"message":{"role":"assistant","content":'
        f.suffix = b'},"done":false}\n'
        f.think_prefix = start + b',"message":{"role":"assistant","content":"","thinking":'
    else:
        f.prefix, f.suffix = start + b',"response":', b',"done":false}\n'
        f.think_prefix = start + b',"response":"","thinking":'

    def whole(text: str, st: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"model": model, "created_at": created}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
            if st.get("thinking") and text:
                out["message"]["thinking"] = st["thinking"]
        else:
            out["response"] = text
            if st.get("thinking") and text:
                out["thinking"] = st["thinking"]
        out.update(done=True, done_reason=st["finish"], total_duration=st["total_ns"],
                   load_duration=st["load_ns"], prompt_eval_count=st["prompt"],
                   prompt_eval_duration=0,
                   eval_count=st["completion"], eval_duration=st["eval_ns"], x_simulated=True)
        return out

    f.headers = NDJSON
    f.whole = whole
    f.tail = lambda st: _enc.encode(whole("", st)) + b"\n"
    return f


def openai_frame(model: str, chat: bool, ident: int, include_usage: bool) -> Frame:
    f = Frame()
    created = int(time.time())
    rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{ident}"
    obj = "chat.completion" if chat else "text_completion"
    meta = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
            "model": model,
            "system_fingerprint": FINGERPRINT}
    base = b"data: " + _enc.encode(meta)[:-1] + b',"choices":[{"index":0,'
    end = b',"logprobs":null,"finish_reason":null}]}\n\n'
    if chat:
        f.head = base + b'"delta":{"role":"assistant","content":""}' + end
        f.prefix, f.suffix = base + b'"delta":{"content":', b"}" + end
        f.think_prefix = base + b'"delta":{"reasoning_content":'
    else:
        f.prefix, f.suffix = base + b'"text":', end

    def usage(st: dict[str, Any]) -> dict[str, Any]:
        # cached_tokens: the prefix cache's hit (sim/cache.py), reported as vLLM does.
        return {"prompt_tokens": st["prompt"], "completion_tokens": st["completion"],
                "total_tokens": st["prompt"] + st["completion"],
                "prompt_tokens_details": {"cached_tokens": st.get("cached", 0)}}

    def tail(st: dict[str, Any]) -> bytes:
        last = base + (b'"delta":{}' if chat else b'"text":""')
        out = last + b',"logprobs":null,"finish_reason":' + _enc.encode(st["finish"])
        if st.get("stop_word"):
            out += b',"stop_reason":' + _enc.encode(st["stop_word"])
        out += b"}]}\n\n"
        if include_usage:
            out += b"data: " + _enc.encode({**meta, "choices": [], "usage": usage(st)}) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def whole(text: str, st: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if st.get("thinking"):
                choice["message"]["reasoning_content"] = st["thinking"]
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=st["finish"])
        if st.get("stop_word"):
            choice["stop_reason"] = st["stop_word"]  # vLLM's field: the sequence matched
        return {**meta, "object": obj, "choices": [choice], "usage": usage(st)}

    f.headers, f.tail, f.whole = SSE, tail, whole
    return f


def count(req: Req) -> tuple[int, str]:
    """How many tokens to answer, and the finish reason."""
    n = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if n is None and req.options is not None:
        n = req.options.num_predict
    if n is None:
        return DEFAULT_TOKENS, "stop"
    return (MAX_TOKENS if n < 0 else min(n, MAX_TOKENS)), "length"
