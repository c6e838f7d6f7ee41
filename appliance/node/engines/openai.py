"""The node's adapter for a fixed OpenAI-compatible upstream (`Engine__Kind=openai`: vLLM,
TGI, a llama.cpp server started elsewhere, ...).

Theory of operation: such an upstream serves the models it was started with, all the
time; the node cannot load or unload anything. So `models()` is `GET /v1/models` (polled
every `Engine__PollSeconds` with the Ollama adapter's loop), every one `ready`; `load()`
succeeds for a model it lists and raises EngineError naming what it does serve
otherwise; `unload()` does nothing. `Engine__Url` may be given with or without `/v1`.
The version is read once from vLLM's `GET /version` where there is one. vLLM's load
(`/metrics`: requests running and waiting per model, `max_num_seqs` where said) is read
every second beside the poll (engines/vllmslots.py) and said as each model's `busy` and
`slots`; an upstream without it is not asked again.
"""

from __future__ import annotations

import logging
from functools import partial

import httpx
import msgspec
import trio

from appliance.config import Config
from appliance.node.engines.base import Changed, EngineError, unheard
from appliance.node.engines.ollama import POLL_ERRORS, POLL_TIMEOUT_SECONDS, PolledEngine
from appliance.node.engines.vllmslots import LOAD_POLL_SECONDS, Load, NotServed, parse, read_metrics
from appliance.wire import EngineInstall, ModelState

log = logging.getLogger(__name__)


class _Model(msgspec.Struct):
    id: str = ""


class _Models(msgspec.Struct):
    data: list[_Model] | None = None


_models_decoder = msgspec.json.Decoder(_Models)


class OpenAIEngine(PolledEngine):
    kind = "openai"

    def __init__(self, cfg: Config, on_change: Changed = unheard) -> None:
        super().__init__(cfg.engine.url.rstrip("/").removesuffix("/v1"), cfg.engine.poll_seconds,
                         on_change)
        self._models: list[str] = []
        self._load: dict[str, Load] = {}  # per model, vLLM's running and waiting
        self._seqs: int | None = None  # vLLM's max_num_seqs, where it says it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(PolledEngine.run, self))
            nursery.start_soon(self._watch_load)
            task_status.started()

    async def _watch_load(self) -> None:
        """vLLM's /metrics every LOAD_POLL_SECONDS while the upstream answers."""
        while True:
            await trio.sleep(LOAD_POLL_SECONDS)
            client = self._client
            if client is None or not self._up:
                continue
            try:
                with trio.fail_after(POLL_TIMEOUT_SECONDS):
                    text = await read_metrics(client)
            except NotServed:
                log.info("openai upstream at %s has no /metrics: its load is not read", self.url)
                self._load, self._seqs = {}, None
                self._notify()
                return
            except POLL_ERRORS:
                text = None
            load, seqs = parse(text) if text is not None else ({}, None)
            if (load, seqs) != (self._load, self._seqs):
                self._load, self._seqs = load, seqs
                self._notify()

    async def refresh(self) -> None:
        client = self._require_client()
        r = await client.get("/v1/models")
        r.raise_for_status()
        models = [m.id for m in _models_decoder.decode(r.content).data or [] if m.id]
        if not self._up:
            self._version = await self._read_version(client)
            log.info("openai upstream at %s answers, serving %s", self.url, ", ".join(models)
                     or "nothing")
        self._up, self._models = True, models
        self._notify()

    @staticmethod
    async def _read_version(client: httpx.AsyncClient) -> str:
        try:
            r = await client.get("/version")
            v = msgspec.json.decode(r.content).get("version", "") if r.status_code == 200 else ""
            return v if isinstance(v, str) else ""
        except (*POLL_ERRORS, AttributeError):
            return ""

    def _forget(self) -> None:
        self._models = []
        self._load, self._seqs = {}, None

    def installs(self) -> list[EngineInstall]:
        return [EngineInstall("openai", self._version)] if self._up else []

    def models(self) -> list[ModelState]:
        out = []
        for m in self._models:
            load = self._load.get(m)
            if load is None:
                out.append(ModelState(name=m, state="ready"))
            else:
                out.append(ModelState(name=m, state="ready", slots=self._seqs, busy=load.busy))
        return out

    def upstream(self, model: str) -> str | None:
        return self.url if model in self._models else None

    async def load(self, model: str, source: str = "", args: str = "") -> None:
        name = source or model
        if name not in self._models:
            try:
                with trio.fail_after(POLL_TIMEOUT_SECONDS):
                    await self.refresh()
            except (*POLL_ERRORS, EngineError) as e:
                raise EngineError(
                    f"openai upstream at {self.url} did not answer: "
                    f"{type(e).__name__}: {e}") from None
        if name not in self._models:
            raise EngineError(f"openai upstream at {self.url} does not serve {name!r}; "
                              f"it serves: {', '.join(self._models) or 'nothing'}")

    async def unload(self, model: str) -> None:
        """A fixed upstream keeps its models; nothing to do."""
