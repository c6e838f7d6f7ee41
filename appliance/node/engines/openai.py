"""The node's adapter for a fixed OpenAI-compatible upstream (`Engine__Kind=openai`: vLLM,
TGI, a llama.cpp server started elsewhere, ...).

Theory of operation: such an upstream serves the models it was started with, all the
time; the node cannot load or unload anything. So `models()` is `GET /v1/models` (polled
every `Engine__PollSeconds` with the Ollama adapter's loop), every one `ready`; `load()`
succeeds for a model it lists and raises EngineError naming what it does serve
otherwise; `unload()` does nothing. `Engine__Url` may be given with or without `/v1`.
The version is read once from vLLM's `GET /version` where there is one.
"""

from __future__ import annotations

import logging

import httpx
import msgspec
import trio

from appliance.config import Config
from appliance.node.engines.base import Changed, EngineError, unheard
from appliance.node.engines.ollama import POLL_ERRORS, POLL_TIMEOUT_SECONDS, PolledEngine
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

    def installs(self) -> list[EngineInstall]:
        return [EngineInstall("openai", self._version)] if self._up else []

    def models(self) -> list[ModelState]:
        return [ModelState(name=m, state="ready") for m in self._models]

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
