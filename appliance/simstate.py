"""The simulated engine's core: its models, their load state, and deterministic output.

Theory of operation: `SimState` holds the configured models (`Sim__Models__N__*`, default
one `sim-small` of 500 MiB), whether each is loaded, and one `trio.Semaphore(Sim__Parallel)`
per model that bounds how many requests generate at once. A load takes `LoadSeconds` of
trio time (so `autojump_clock` tests skip it) and, when `FailLoad` is set, then fails with
that text and leaves the model unloaded -- the way an engine fails on an architecture it
does not know. Loaded models stay loaded until unloaded (no keep-alive expiry).

Output is a pure function of a seed (the model and the prompt or messages): `tokens`
picks words with a PRNG seeded by it, `embedding` hashes it. The JSON of every word is
encoded once at import, so streaming a token costs one bytes join in `appliance.sim`.
No HTTP here; `appliance.sim` is the server around it.
"""

from __future__ import annotations

import hashlib
import logging
import random
import struct
import time
from typing import Any

import msgspec
import trio

from appliance.config import SimConfig, SimModel

log = logging.getLogger("appliance.sim")

EMBED_DIM = 16
_VOCAB = (
    "the quick brown fox jumps over a lazy dog while seven small engines hum along in "
    "quiet racks of warm metal and every token arrives on time through the long night "
    "as operators sleep because nothing failed today except one model that was parked "
    "with its last error shown clearly for all to read"
).split()
_enc = msgspec.json.Encoder()
# (text, JSON) of each token: the first word of an answer bare, every later one spaced.
_FIRST = tuple((w, _enc.encode(w)) for w in _VOCAB)
_LATER = tuple((" " + w, _enc.encode(" " + w)) for w in _VOCAB)


class SimError(Exception):
    """A refusal before the response starts; rendered in the shape of the request's API."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Msg(msgspec.Struct):
    role: str = ""
    content: Any = ""


class Options(msgspec.Struct):
    num_predict: int | None = None


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


req_decoder = msgspec.json.Decoder(Req)


def tokens(seed: bytes, n: int) -> list[tuple[str, bytes]]:
    """n (text, JSON) tokens, the same for the same seed."""
    if n <= 0:
        return []
    rng = random.Random(seed)
    return [rng.choice(_FIRST), *rng.choices(_LATER, k=n - 1)]


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
                fresh.loaded = m is not None and m.spec == spec and m.loaded
                m = fresh
            self.models[spec.name] = m

    def lookup(self, name: str) -> SimModelState | None:
        """Ollama treats `x` and `x:latest` as one model."""
        m = self.models.get(name)
        if m is None:
            m = self.models.get(name[:-7] if name.endswith(":latest") else name + ":latest")
        return m

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    async def ensure_loaded(self, m: SimModelState) -> None:
        """Load `m` unless it is loaded; SimError(500) with the FailLoad text on failure."""
        if m.loaded:
            return
        async with m.lock:
            if m.loaded:
                return
            await trio.sleep(m.spec.load_seconds)
            m.loads += 1
            if m.spec.fail_load:
                log.info("sim: load of %s fails as configured: %s", m.spec.name, m.spec.fail_load)
                raise SimError(500, "model_load_failed", m.spec.fail_load)
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
