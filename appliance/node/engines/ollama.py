"""The node's adapter for a local Ollama (`Engine__Kind=ollama`), and the polling loop the
HTTP adapters share.

Theory of operation: Ollama owns its models; this adapter only reads and asks. `run()`
opens one httpx client to `Engine__Url` and polls `/api/tags` (what exists), `/api/ps`
(what is loaded) and `/api/version` every `Engine__PollSeconds`, calling `on_change()`
when what it reports differs from the last report. A model is `ready` while `/api/ps`
lists it, `loading` while our `load()` waits, `failed` (with Ollama's own words as
`last_error`) after a load that failed, else `available`. `load()` is Ollama's own: a
generate request with no prompt and `keep_alive: -1` (stay loaded; the hub decides when
to unload), `unload()` the same with `keep_alive: 0`.

An Ollama that does not answer is not an error of the node: `run()` still reports started,
says so by listing no installs and no models, and keeps asking with a capped doubling
backoff (logging once when it goes away and once when it is back). Names: Ollama treats
`llama3` and `llama3:latest` as one model; a load asked under a catalog name or source
that Ollama lists under another name is reported under both, so the hub finds the name
it asked for. Profile `args` mean nothing to Ollama and are ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import trio

from appliance.config import Config, MiB
from appliance.node.engines.base import Changed, Engine, EngineError, unheard
from appliance.node.engines.params import OLLAMA
from appliance.wire import EngineInstall, ModelMeta, ModelState, ModelStatus

log = logging.getLogger(__name__)

# One poll (tags + ps + version) that takes longer than this counts as the engine being
# away: Ollama answers these from memory in milliseconds even while it loads a model.
POLL_TIMEOUT_SECONDS = 10.0
# Backoff while the engine does not answer: 1, 2, 4 ... capped at 30 s, so an engine that
# comes up after the node (systemd ordering, a restart) is seen within half a minute.
RETRY_FIRST_SECONDS = 1.0
RETRY_MAX_SECONDS = 30.0
# Connect is bounded here; reads are not, because a load's generate request answers only
# once the model is in memory -- the node bounds it with Engine__StartTimeoutSeconds and
# polls with POLL_TIMEOUT_SECONDS, at the call sites.
CLIENT_TIMEOUT = httpx.Timeout(connect=5.0, read=None, write=30.0, pool=30.0)
POLL_ERRORS = (httpx.HTTPError, trio.TooSlowError, msgspec.DecodeError)


async def poll_engine(
    refresh: Callable[[], Awaitable[None]],
    poll_seconds: float,
    on_error: Callable[[Exception], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `refresh()` every `poll_seconds`; after a failure, `on_error(e)` and retry with
    capped doubling backoff. Reports started after the first attempt, whatever its outcome."""
    delay = RETRY_FIRST_SECONDS
    started = False
    while True:
        try:
            with trio.fail_after(POLL_TIMEOUT_SECONDS):
                await refresh()
            wait, delay = poll_seconds, RETRY_FIRST_SECONDS
        except POLL_ERRORS as e:
            on_error(e)
            wait, delay = delay, min(delay * 2, RETRY_MAX_SECONDS)
        if not started:
            started = True
            task_status.started()
        await trio.sleep(wait)


def mib(size_bytes: int) -> int:
    return -(-size_bytes // MiB)


def error_text(r: httpx.Response) -> str:
    """The engine's own words from an error response (`{"error": ...}` in either API's shape)."""
    try:
        err = msgspec.json.decode(r.content).get("error")
    except (msgspec.DecodeError, AttributeError):
        err = None
    if isinstance(err, dict):
        err = err.get("message")
    return err if isinstance(err, str) and err else f"HTTP {r.status_code}: {r.text[:300]}"


class _Details(msgspec.Struct):
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class _Tag(msgspec.Struct):
    name: str = ""
    model: str = ""
    size: int = 0
    digest: str = ""
    modified_at: str = ""
    details: _Details | None = None
    context_length: int = 0

    def meta(self) -> ModelMeta:
        d = self.details or _Details()
        return ModelMeta(digest=self.digest, modified_at=self.modified_at, format=d.format,
                         family=d.family,
                         families=d.families, parameter_size=d.parameter_size,
                         quantization_level=d.quantization_level,
                         context_length=self.context_length)


class _Tags(msgspec.Struct):
    models: list[_Tag] | None = None


class _Show(msgspec.Struct):
    capabilities: list[str] | None = None


_show_decoder = msgspec.json.Decoder(_Show)
# /api/show calls per poll for models whose capabilities are not known yet (one per new
# model or digest; the rest wait for the next poll); what one may list, and how long a word.
SHOWS_PER_POLL = 16
MAX_CAPABILITIES = 16
MAX_CAPABILITY_CHARS = 32


class _Version(msgspec.Struct):
    version: str = ""


_tags_decoder = msgspec.json.Decoder(_Tags)
_version_decoder = msgspec.json.Decoder(_Version)


def _tagged(name: str) -> str:
    """Ollama's canonical spelling: a name without a tag means `:latest`."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


class PolledEngine(Engine):
    """An engine reached over HTTP at `url`, re-read every `poll_seconds` by `refresh`.

    Owns the one httpx client, the polling loop and what happens when the engine stops
    answering (`_away`: log once, forget what it said, tell the node); subclasses say
    what to read (`refresh`) and what to forget (`_forget`).
    """

    def __init__(self, url: str, poll_seconds: float, on_change: Changed = unheard) -> None:
        super().__init__(on_change)
        self.url = url
        self.poll_seconds = poll_seconds
        self._client: httpx.AsyncClient | None = None
        self._up = False
        self._version = ""
        self._last: object = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=CLIENT_TIMEOUT) as client:
            self._client = client
            try:
                await poll_engine(self.refresh, self.poll_seconds, self._away,
                                  task_status=task_status)
            finally:
                self._client = None

    async def refresh(self) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop what the engine said: it does not answer."""

    def _away(self, e: Exception) -> None:
        if self._up or self._last is None:
            log.warning("%s at %s does not answer (%s: %s); retrying with backoff",
                        self.kind, self.url, type(e).__name__, e)
        self._up = False
        self._forget()
        self._notify()

    def _notify(self) -> None:
        now = (self.installs(), self.models(), self.memory_used_mb())
        if now != self._last:
            self._last = now
            self.on_change()

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineError(f"{self.kind} adapter is not running")
        return self._client


class OllamaEngine(PolledEngine):
    kind = "ollama"

    def __init__(self, cfg: Config, on_change: Changed = unheard) -> None:
        super().__init__(cfg.engine.url.rstrip("/"), cfg.engine.poll_seconds, on_change)
        self._tags: dict[str, int] = {}  # name -> size MiB, from /api/tags
        self._ps: dict[str, int] = {}  # name -> MiB in memory, from /api/ps
        self._meta: dict[str, ModelMeta] = {}  # name -> what tags (and ps: context length) say
        self._loading: set[str] = set()
        self._failed: dict[str, str] = {}  # name -> the engine's words
        self._alias: dict[str, str] = {}  # name the hub asked for -> name Ollama lists
        # (name, digest) -> what /api/show says it can do (None: it said nothing)
        self._caps: dict[tuple[str, str], list[str] | None] = {}

    # --- the long-lived part -------------------------------------------------------------

    async def refresh(self) -> None:
        """Read tags, ps (and the version once per connection); tell the node if anything
        changed."""
        client = self._require_client()
        tags = await self._get_tags(client, "/api/tags")
        ps = await self._get_tags(client, "/api/ps")
        if not self._up:
            r = await client.get("/api/version")
            r.raise_for_status()
            self._version = _version_decoder.decode(r.content).version
            log.info("%s at %s answers (version %s)", self.kind, self.url, self._version
                     or "unknown")
        self._up = True
        self._tags = {t.name or t.model: mib(t.size) for t in tags}
        self._ps = {t.name or t.model: mib(t.size) for t in ps}
        meta = {t.name or t.model: t.meta() for t in tags}
        for t in ps:
            name = t.name or t.model
            if name in meta and t.context_length:
                meta[name].context_length = t.context_length
        await self._read_capabilities(client, tags)
        for t in tags:
            meta[t.name or t.model].capabilities = self._caps.get((t.name or t.model, t.digest))
        self._meta = meta
        for name in self._ps:
            self._failed.pop(name, None)
        self._notify()

    async def _read_capabilities(self, client: httpx.AsyncClient, tags: list[_Tag]) -> None:
        """Ask /api/show what each new model (or new digest) can do; a bounded few a poll."""
        keys = {(t.name or t.model, t.digest) for t in tags}
        self._caps = {k: v for k, v in self._caps.items() if k in keys}
        for name, digest in sorted(keys - set(self._caps))[:SHOWS_PER_POLL]:
            r = await client.post("/api/show", json={"model": name})
            caps = None
            if r.status_code == 200:
                try:
                    said = _show_decoder.decode(r.content).capabilities
                except (msgspec.DecodeError, msgspec.ValidationError):
                    said = None
                if said is not None:
                    caps = [c for c in said[:MAX_CAPABILITIES]
                            if 0 < len(c) <= MAX_CAPABILITY_CHARS]
            self._caps[(name, digest)] = caps

    @staticmethod
    async def _get_tags(client: httpx.AsyncClient, path: str) -> list[_Tag]:
        r = await client.get(path)
        r.raise_for_status()
        return _tags_decoder.decode(r.content).models or []

    def _forget(self) -> None:
        self._tags, self._ps, self._meta = {}, {}, {}

    # --- what the node reads -----------------------------------------------------------

    def installs(self) -> list[EngineInstall]:
        return [EngineInstall(self.kind, self._version)] if self._up else []

    def _resolve(self, name: str) -> str:
        """The name Ollama lists for `name` (`x` is `x:latest`), else `name` itself."""
        if name in self._tags or name in self._ps:
            return name
        tagged = _tagged(name)
        return tagged if tagged in self._tags or tagged in self._ps else name

    def _state(self, name: str, target: str) -> ModelState:
        state: ModelStatus
        if target in self._loading:
            state = "loading"
        elif target in self._ps:
            state = "ready"
        elif target in self._failed:
            state = "failed"
        else:
            state = "available"
        size = self._tags.get(target) or self._ps.get(target, 0)
        return ModelState(name=name, size_mb=size, state=state, last_error=self._failed.get(target,
                                                                                            ""),
                          meta=self._meta.get(target))

    def models(self) -> list[ModelState]:
        if not self._up:
            return []  # an engine that does not answer serves nothing
        names = dict.fromkeys([*self._tags, *self._ps, *self._loading, *self._failed])
        out = [self._state(n, n) for n in names]
        out += [self._state(a, t) for a, t in self._alias.items() if a not in names]
        return out

    def memory_used_mb(self) -> int:
        return sum(self._ps.values())

    def dialect(self, model: str) -> str:
        """Ollama's OpenAI routes take `max_tokens`, not `max_completion_tokens`."""
        return OLLAMA

    def upstream(self, model: str) -> str | None:
        if not self._up:
            return None
        target = self._alias.get(model) or self._resolve(model)
        return self.url if target in self._tags or target in self._ps else None

    # --- what the node asks ------------------------------------------------------------

    async def load(self, model: str, source: str = "", args: str = "") -> None:
        client = self._require_client()
        target = self._resolve(source or model)
        if target != model:
            self._alias[model] = target
        self._loading.add(target)
        self._failed.pop(target, None)
        self._notify()
        done = False
        try:
            try:
                r = await client.post("/api/generate", json={"model": source or model,
                                                             "keep_alive": -1})
            except httpx.HTTPError as e:
                raise EngineError(
                    f"{self.kind} at {self.url} did not answer: {type(e).__name__}: {e}") from None
            if r.status_code != 200:
                raise EngineError(error_text(r))
            self._ps.setdefault(target, self._tags.get(target, 0))
            done = True
            log.info("%s loaded %s", self.kind, target)
        except EngineError as e:
            self._failed[target] = str(e)
            log.warning("%s refused to load %s: %s", self.kind, target, e)
            raise
        finally:
            self._loading.discard(target)
            if not done and target not in self._failed:
                self._failed[target] = "the load was cancelled before the engine answered"
            self._notify()

    async def unload(self, model: str) -> None:
        client = self._require_client()
        target = self._alias.get(model) or self._resolve(model)
        try:
            r = await client.post("/api/generate", json={"model": target, "keep_alive": 0})
        except httpx.HTTPError as e:
            raise EngineError(
                f"{self.kind} at {self.url} did not answer: {type(e).__name__}: {e}") from None
        if r.status_code not in (200, 404):  # 404: Ollama does not know it, so nothing is loaded
            raise EngineError(error_text(r))
        self._ps.pop(target, None)
        log.info("%s unloaded %s", self.kind, target)
        self._notify()
