"""Generation probes: the trio shell around node/health.py's `ReplicaHealth`.

Theory of operation: `run_probes` is one long-lived task in the node's nursery. It wakes
when something falls due (a probe, a streamed request's first-byte bound) and at least
every TICK_SECONDS to see newly ready models, hands the core the ready models and the
time, and starts each due probe as its own task: a one-token, non-streamed chat completion
to the model's engine, bounded by `Node__ProbeTimeoutSeconds`. A 500/502/503/504, a broken
connection or no answer in time is a failed probe; any other answer is an engine that
answers (a 4xx or 501 to a chat: an embedding-only model, say).

A replica newly marked unhealthy whose process the node manages (`Engine.restart`:
llamacpp) is restarted here, bounded by `Engine__StartTimeoutSeconds`, with its load
published as any other (loading, then ready or failed) -- the hub counts the unhealthy
replica toward parking like a failed start. Probes go to the engine directly: they never
pass the node's admission nor any key's limits, and are not requests in its counts.
"""

from __future__ import annotations

import logging

import httpx
import msgspec
import trio

from appliance.bounds import CLEANUP_SECONDS
from appliance.client.upstream import Pool, UpstreamError
from appliance.config import Config
from appliance.node.engines.base import Engine, EngineError
from appliance.node.engines.params import fit
from appliance.node.health import ReplicaHealth
from appliance.node.state import NodeStateKeeper

log = logging.getLogger("appliance.node.probe")

# A newly ready model is seen within this long; a wake a second costs microseconds.
TICK_SECONDS = 1.0
PROBE_PATH = "/v1/chat/completions"
# What a probe's answer may say of itself, kept as the replica's error (bounded).
ERROR_CHARS = 300
_JSON = [(b"content-type", b"application/json")]
# Answers that say the engine cannot generate. Any other is an engine that answered: a 4xx
# or llama-server's 501 to a chat on an embedding-only model is not a hang.
FAILED = frozenset((500, 502, 503, 504))


def probe_body(model: str) -> bytes:
    """One token of a chat completion: the cheapest generation every engine here serves."""
    return msgspec.json.encode({"model": model, "max_tokens": 1, "stream": False,
                                "messages": [{"role": "user", "content": "Say OK."}]})


async def probe_once(pool: Pool, upstream: str, model: str, dialect: str,
                     read_seconds: float) -> str | None:
    """One probe of `model` at `upstream`: None when it generated, else why not. No bound
    of its own: the caller's `move_on_after` is the probe timeout."""
    body = fit(dialect, PROBE_PATH, probe_body(model))
    try:
        resp = await pool.request("POST", upstream + PROBE_PATH, _JSON, body, read_seconds)
    except UpstreamError as e:
        return f"generation probe failed: {e}"
    try:
        text = await resp.read()
    except UpstreamError as e:
        return f"generation probe broke off: {e}"
    finally:
        if not resp.released:
            with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                await resp.aclose()
    if resp.status_code in FAILED:
        words = text[:ERROR_CHARS].decode("utf-8", "replace")
        return f"generation probe answered {resp.status_code}: {words}"
    return None


class Prober:
    """The shell's state: the core, what it reads and whom it calls."""

    def __init__(self, cfg: Config, health: ReplicaHealth, keeper: NodeStateKeeper,
                 engine: Engine, pool: Pool) -> None:
        self.cfg, self.health, self.keeper, self.engine, self.pool = (cfg, health, keeper,
                                                                       engine, pool)
        self._nursery: trio.Nursery | None = None
        self._restarting: set[str] = set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.health.on_unhealthy = self._unhealthy
            task_status.started()
            while True:
                now = trio.current_time()
                self.health.loaded([m.name for m in self.engine.models() if m.state == "ready"],
                                   now)
                self.health.check(now)
                for model in self.health.due(now):
                    nursery.start_soon(self._probe, model)
                await trio.sleep_until(min(self.health.next_check(now), now + TICK_SECONDS))

    async def _probe(self, model: str) -> None:
        timeout = self.health.timeout
        error: str | None = None
        upstream = self.engine.upstream(model)
        if upstream is not None:
            with trio.move_on_after(timeout) as cs:
                error = await probe_once(self.pool, upstream, model, self.engine.dialect(model),
                                         timeout)
            if cs.cancelled_caught:
                error = f"no answer to a one-token generation in {timeout:g} s"
        before = self.health.unhealthy(model)
        self.health.probe_done(model, error, trio.current_time())
        if error is not None and error != before:
            log.warning("model %s unhealthy: %s", model, error)
        elif error is None and before:
            log.info("model %s healthy again: a probe generated", model)

    def _unhealthy(self, model: str) -> None:
        """Newly unhealthy: restart the process where the node manages it."""
        if self._nursery is None or not self.engine.restartable or model in self._restarting:
            return
        self._restarting.add(model)
        self._nursery.start_soon(self._restart, model)

    async def _restart(self, model: str) -> None:
        k, timeout = self.keeper, self.cfg.engine.start_timeout_seconds
        log.warning("restarting the engine process of %s (unhealthy: %s)", model,
                    self.health.unhealthy(model))
        k.load_started(model)
        try:
            with trio.move_on_after(timeout) as cs:
                await self.engine.restart(model)
            if cs.cancelled_caught:
                k.load_failed(model, f"restart after a failed probe: health never came in "
                                     f"{timeout:g} s")
            else:
                k.load_done(model)
                log.info("%s restarted and ready", model)
        except (EngineError, httpx.HTTPError, OSError) as e:
            k.load_failed(model, f"restart after a failed probe: {e or type(e).__name__}")
        finally:
            self._restarting.discard(model)
