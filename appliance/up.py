"""`appliance up`: a hub and one local node in one process, for a single box or a first look.

Theory of operation: ask 127.0.0.1:11434 whether an Ollama answers (bounded by
PROBE_SECONDS); if it does, the node fronts it, otherwise the node runs the built-in
simulated engine -- and says so loudly, because an operator must never mistake the
simulator for a real model. The hub listens on 127.0.0.1:8080 unless Hub__Listen says
otherwise, the node on a free loopback port unless Node__Listen says otherwise, and the
hub knows the node statically. One process has one metrics listener: the hub's
(`Metrics__Listen`, off by default here); the node's is off, its series are the hub's
concern. Both run in one trio nursery: one SIGTERM drains both and exits 0. systemd's
watchdog is fed from the hub's control loop, as `appliance hub` does. SIGHUP re-reads
the env file once and applies it to both parts: the hub's reload (its listener limits,
keys, models...; one line naming what waits for the next start), then the node's, as
`appliance node` does (Node__MaxConcurrency, ModelSlots, MemoryMb, the sim's models, and
its listener's limits: Node__HeaderReadSeconds, Node__BodyReadSeconds,
Hub__MaxConnections, Hub__MaxBufferedBytes). The engine (Ollama or the sim, chosen at
the start) and both listen addresses stay until the next start.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING

import httpx
import msgspec
import trio

from appliance.config import Config, NodeRef, StoreConfig
from appliance.hub.run import SIGNALS, HubStarted, handle_signals, reload_hub, run_hub

if TYPE_CHECKING:
    from appliance.observe.sdnotify import Notifier

log = logging.getLogger("appliance.up")

OLLAMA_URL = "http://127.0.0.1:11434"
# An Ollama on loopback answers /api/version in milliseconds; a second is plenty.
PROBE_SECONDS = 1.0
UP_HUB_LISTEN = "127.0.0.1:8080"
UP_NODE_LISTEN = "127.0.0.1:0"
DEFAULT_NODE_LISTEN = "0.0.0.0:9090"  # config's default: not set by the operator
# What the running node part does not take on SIGHUP (bound socket and its TLS, its name,
# the drain bound, its timers and body bound); a change is named in a log line.
NODE_AT_NEXT_START: dict[str, Callable[[Config], object]] = {
    "Node__Listen": lambda c: c.node.listen, "Node__Name": lambda c: c.node.name,
    "Node__AdvertiseUrl": lambda c: c.node.advertise_url,
    "Node__TlsCert": lambda c: c.node.tls_cert, "Node__TlsKey": lambda c: c.node.tls_key,
    "Node__TlsCa": lambda c: c.node.tls_ca, "Node__DrainSeconds": lambda c: c.node.drain_seconds,
    "Node__HeartbeatSeconds": lambda c: c.node.heartbeat_seconds,
    "Node__MaxBodyBytes": lambda c: c.node.max_body_bytes,
    "Node__UpstreamReadSeconds": lambda c: c.node.upstream_read_seconds,
}


async def ollama_answers(url: str = OLLAMA_URL) -> bool:
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(PROBE_SECONDS)) as c:
            r = await c.get(url + "/api/version")
            return r.status_code == 200
    except httpx.HTTPError:
        return False


def up_config(cfg: Config, use_ollama: bool) -> Config:
    """The single-box configuration: loopback hub, a local node on a free port."""
    hub = cfg.hub if cfg.hub.listen != "0.0.0.0:8080" else msgspec.structs.replace(cfg.hub,
                                                                                   listen=UP_HUB_LISTEN)
    listen = UP_NODE_LISTEN if cfg.node.listen == DEFAULT_NODE_LISTEN else cfg.node.listen
    node = msgspec.structs.replace(cfg.node, listen=listen, name=cfg.node.name or "local")
    engine = msgspec.structs.replace(cfg.engine, kind="ollama" if use_ollama else "sim",
                                     url=OLLAMA_URL if use_ollama else cfg.engine.url)
    metrics = cfg.metrics if cfg.metrics.listen is not None else msgspec.structs.replace(
        cfg.metrics, listen="")
    store = cfg.store if cfg.store.path != StoreConfig().path else msgspec.structs.replace(
        cfg.store, path=user_store_path())
    return msgspec.structs.replace(cfg, hub=hub, node=node, engine=engine, metrics=metrics,
                                   store=store)


def user_store_path() -> str:
    """The per-user store (XDG Base Directory: $XDG_STATE_HOME, else ~/.local/state)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return os.path.join(base, "appliance", "store.db")


async def _main(cfg: Config, env_file: str | None) -> None:
    from appliance.observe import sdnotify

    use_ollama = cfg.engine.kind == "ollama" and await ollama_answers()
    cfg = up_config(cfg, use_ollama)
    if use_ollama:
        print(f"appliance up: using the local Ollama at {OLLAMA_URL}", file=sys.stderr, flush=True)
    else:
        print("appliance up: NO OLLAMA at 127.0.0.1:11434 -- using the built-in SIMULATED engine "
              f"(models: {', '.join(m.name for m in cfg.sim.effective_models())}); answers are not "
              "from a real model",
              file=sys.stderr, flush=True)
    notifier = sdnotify.Notifier.from_env()
    stop = trio.Event()
    with trio.open_signal_receiver(*SIGNALS) as signals:
        await _run(cfg, env_file, notifier, stop, signals)


async def _run(cfg: Config, env_file: str | None, notifier: Notifier, stop: trio.Event,
               signals: AsyncIterator[int]) -> None:
    from appliance.node.run import run_node
    from appliance.observe import sdnotify

    heartbeat = sdnotify.Liveness(max_age=3 * cfg.hub.control_interval_seconds)
    # One metrics listener per process: the hub's. Both binding Metrics__Listen is EADDRINUSE.
    def no_metrics(c: Config) -> Config:
        return msgspec.structs.replace(c, metrics=msgspec.structs.replace(c.metrics, listen=""))

    node_only = no_metrics(cfg)
    hub_done = trio.Event()
    watchdog = trio.CancelScope()
    # One pending node reload is enough: a second SIGHUP before it is applied read the same file.
    node_reloads, node_reloads_in = trio.open_memory_channel[Config](1)

    async with node_reloads, trio.open_nursery() as nursery:
        node_host, node_port = await nursery.start(partial(run_node, node_only, stop,
                                                           reloads=node_reloads_in))
        local = NodeRef(name=cfg.node.name, url=f"http://{node_host}:{node_port}")
        node_cfg = msgspec.structs.replace(cfg, nodes=[*cfg.nodes, local])

        def adjust(new: Config) -> Config:
            """A reloaded Config, made the single-box one as at the start."""
            new = up_config(new, cfg.engine.kind == "ollama")
            return msgspec.structs.replace(new, nodes=[*new.nodes, local])

        async def hub_task(*, task_status: HubStarted = trio.TASK_STATUS_IGNORED) -> None:
            try:
                # the control loop's every turn feeds the watchdog
                await run_hub(node_cfg, stop, beat=heartbeat.beat, task_status=task_status)
            finally:
                hub_done.set()

        async def feed_watchdog() -> None:
            with watchdog:
                await sdnotify.watchdog_loop(notifier, heartbeat)

        hub, _addr = await nursery.start(hub_task)
        notifier.ready()
        nursery.start_soon(feed_watchdog)
        def reload_both() -> None:
            new = reload_hub(hub, env_file, adjust)
            if new is None:
                return  # refused, one line said why: the node keeps its configuration too
            later = [var for var, get in NODE_AT_NEXT_START.items() if get(new) != get(cfg)]
            if later:
                log.warning("node part: changed, applied only at the next start: %s",
                            ", ".join(later))
            try:
                node_reloads.send_nowait(no_metrics(new))
            except trio.WouldBlock:
                log.warning("a node reload is already pending; this SIGHUP is folded into it")

        nursery.start_soon(handle_signals, signals, stop, notifier, reload_both, "up")
        # The hub and the node drain on the same stop event and return; so does this.
        await hub_done.wait()
        watchdog.cancel()


def main(cfg: Config, env_file: str | None = None) -> int:
    from appliance.hub.observe.audit import check_path

    err = check_path(cfg.audit.path)
    if err is not None:
        print(f"appliance up: {err}", file=sys.stderr)
        return 2
    trio.run(_main, cfg, env_file)
    return 0
