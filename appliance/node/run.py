"""The node process: one nursery holding every long-lived part (DESIGN 1).

Theory of operation: `run_node` builds the engine adapter (`make_engine`), the state
keeper and the app, then starts with `nursery.start` the engine supervisor, the GPU
memory reader, the node API server, the metrics server (`Metrics__Listen`, default
0.0.0.0:9465, empty: none), the generation prober (node/probe.py; `Node__ProbeSeconds`
0: none) and one announcer per hub in `Hub__Url`. It hands the
bound API address to `task_status.started` only once all of it listens.

`run_node` installs no signal handlers, so `appliance up` can run it beside the hub in
one `trio.run`: a stop is the caller's `stop` event, a reload a new Config sent on the
caller's `reloads` channel. On stop the keeper drains (new requests get 503, watch
streams end, so the hub stops routing here), the API server stops accepting and lets
in-flight work finish for `Node__DrainSeconds`, then everything else is cancelled. `main`
owns the signals: SIGTERM/SIGINT stop,
SIGHUP re-reads the env file -- the node's limits (Node__MaxConcurrency, ModelSlots,
MemoryMb) and its listeners' (Node__HeaderReadSeconds, Node__BodyReadSeconds,
Hub__MaxConnections, Hub__MaxBufferedBytes: for new connections and requests) apply at
once, anything else at the next start -- and the exit code is 0.

TLS: with Node__TlsCert the node API speaks HTTPS; with Node__TlsCa too, a client
certificate signed by that CA is required at the handshake -- the hub shows Hub__TlsCert,
and the owner's curl on the box needs `--cert` (the hub's certificate, or one of its own).
"""

from __future__ import annotations

import gc
import logging
import shutil
import signal
import socket
import subprocess
from functools import partial

import trio
from prometheus_client import CollectorRegistry

from appliance import config as config_mod
from appliance.config import Config
from appliance.node.announce import announce_loop, hub_client
from appliance.node.app import NodeApp
from appliance.node.engines import make_engine
from appliance.node.engines.base import Engine
from appliance.node.health import ReplicaHealth
from appliance.node.metrics import NodeMetrics
from appliance.node.probe import Prober
from appliance.node.state import NVIDIA_SMI, NodeStateKeeper, parse_nvidia_smi
from appliance.observe import sdnotify, trace
from appliance.observe.metricsapp import metrics_app
from appliance.server.limits import Limits, LiveLimits
from appliance.server.serve import Bound, same_port, serve
from appliance.wire import Announce

log = logging.getLogger(__name__)

# DESIGN 9: the node's metrics listener unless Metrics__Listen says otherwise.
NODE_METRICS_DEFAULT = "0.0.0.0:9465"
# nvidia-smi costs ~50 ms of CPU; every 5 s shows an owner's game within one hub heartbeat
# window or two, without flooding the watch stream with jitter in `used`.
GPU_POLL_SECONDS = 5.0
# A wedged driver can make nvidia-smi hang; past this the reading is skipped.
NVIDIA_SMI_TIMEOUT = 10.0
# Closing the app (its engine pool) at exit: each idle connection's close, on loopback.
POOL_CLOSE_SECONDS = 2.0


def node_limits(cfg: Config) -> Limits:
    """The node's listeners: its own read deadlines; connection and buffer bounds as the hub's."""
    return Limits(cfg.node.header_read_seconds, cfg.node.body_read_seconds, cfg.hub.max_connections,
                  cfg.hub.max_buffered_bytes, cfg.node.max_body_bytes,
                  cfg.node.write_stall_seconds,
                  min_read_bytes_per_second=cfg.node.min_read_bytes_per_second)


def _limits_line(lim: Limits) -> str:
    return (f"Node__HeaderReadSeconds={lim.header_read_seconds:g}, Node__BodyReadSeconds="
            f"{lim.body_read_seconds:g}, Hub__MaxConnections={lim.max_connections}, "
            f"Hub__MaxBufferedBytes={lim.max_buffered_bytes}")


def advertise_url(cfg: Config, host: str, port: int) -> str:
    """Node__AdvertiseUrl, else the bound address with the host name in place of 0.0.0.0."""
    if cfg.node.advertise_url:
        return cfg.node.advertise_url.rstrip("/")
    scheme = "https" if cfg.node.tls_cert else "http"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _read_nvidia_smi(exe: str) -> str:
    """Blocking; runs in a worker thread."""
    out = subprocess.run([exe, *NVIDIA_SMI[1:]], capture_output=True, text=True,
                         timeout=NVIDIA_SMI_TIMEOUT)
    if out.returncode != 0:
        raise OSError(f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}")
    return out.stdout


async def poll_gpu_memory(keeper: NodeStateKeeper, every: float,
                          *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Feed the keeper nvidia-smi's numbers; the first reading is in before `started`."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        log.info("no nvidia-smi: memory is Node__MemoryMb and the engine's own account")
        task_status.started()
        return
    problem: str | None = None
    while True:
        try:
            text = await trio.to_thread.run_sync(_read_nvidia_smi, exe, abandon_on_cancel=True)
            reading = parse_nvidia_smi(text)
            now = None if reading is not None else f"unreadable output {text.strip()[:200]!r}"
        except (OSError, subprocess.SubprocessError) as e:
            reading, now = None, str(e)
        if now and now != problem:
            log.warning("nvidia-smi: %s (memory falls back to Node__MemoryMb)", now)
        problem = now
        keeper.set_gpu_memory(reading)
        task_status.started()
        task_status = trio.TASK_STATUS_IGNORED
        await trio.sleep(every)


async def apply_reloads(keeper: NodeStateKeeper, engine: Engine,
                        reloads: trio.MemoryReceiveChannel[Config],
                        listeners: LiveLimits | None = None) -> None:
    """Apply each reloaded Config: the node's limits, its listeners' limits, and the
    engine's own settings where the adapter takes them (`reconfigure`, e.g. the sim's
    model list)."""
    async with reloads:
        async for new in reloads:
            reconfigure = getattr(engine, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(new)
            changes = keeper.apply_limits(new.node)
            if keeper.health is not None:
                keeper.health.configure(new.node.probe_seconds,
                                        new.node.probe_timeout_seconds)
            if listeners is not None and listeners.set(node_limits(new)):
                changes.append("listener limits now " + _limits_line(listeners.now))
            if changes:
                log.info("configuration reloaded: %s", "; ".join(changes))
            else:
                log.info(
                    "configuration reloaded: no node limit changed (Node__MaxConcurrency, "
                    "ModelSlots, MemoryMb and the listener limits apply at once; other settings "
                    "at the next start)")


async def run_node(cfg: Config, stop: trio.Event | None = None, *,
                   reloads: trio.MemoryReceiveChannel[Config] | None = None,
                   registry: CollectorRegistry | None = None,
                   task_status: trio.TaskStatus[tuple[str,
                                                      int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a node until `stop` is set, then drain and return. Reports the bound
    (host, port) of the node API once every listener is bound."""
    stop = stop if stop is not None else trio.Event()
    name = cfg.node_name()
    # The keeper reads the engine and the engine tells the keeper of each change (only once it
    # runs): the one pair built around each other.
    engine = make_engine(cfg, on_change=lambda: keeper.changed())
    keeper = NodeStateKeeper(name, cfg.node, engine)
    if cfg.node.probe_seconds > 0:  # generation probes (node/health.py, node/probe.py)
        keeper.health = ReplicaHealth(cfg.node.probe_seconds, cfg.node.probe_timeout_seconds,
                                      on_change=keeper.changed)
    metrics = NodeMetrics(registry if registry is not None else CollectorRegistry(), keeper)
    limits = LiveLimits(node_limits(cfg))  # both listeners; a reload sets new ones
    async with hub_client(cfg) as hclient, trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        await nursery.start(poll_gpu_memory, keeper, GPU_POLL_SECONDS)
        tracing = trace.setup("appliance-node")  # None without OTEL_EXPORTER_OTLP_ENDPOINT
        if tracing is not None:
            metrics.registry.register(trace.DroppedCollector(tracing))
        app = NodeApp(cfg, keeper, engine, metrics, tracing)
        nursery.start_soon(app.proxy.pool.sweep_every)  # idle engine connections closed promptly
        if keeper.health is not None:
            await nursery.start(Prober(cfg, keeper.health, keeper, engine, app.proxy.pool).run)
        api_stop, api_done = trio.Event(), trio.Event()

        async def api_server(*, task_status: Bound = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(app, cfg.node.listen, "node", shutdown_trigger=api_stop.wait,
                            limits=limits,
                            drain_seconds=cfg.node.drain_seconds, certfile=cfg.node.tls_cert,
                            keyfile=cfg.node.tls_key, ca_certs=cfg.node.tls_ca,
                            require_client_cert=True,
                            task_status=task_status)
            finally:
                api_done.set()

        metrics_listen = NODE_METRICS_DEFAULT if cfg.metrics.listen is None else cfg.metrics.listen
        same_port(metrics_listen, cfg.node.listen, "Node__Listen")
        host, port = await nursery.start(api_server)
        if metrics_listen:
            await nursery.start(partial(serve, metrics_app(metrics.registry, [metrics.refresh]),
                                        metrics_listen,
                                        "metrics", shutdown_trigger=api_stop.wait, drain_seconds=1,
                                        limits=limits))
        url = advertise_url(cfg, host, port)
        for hub_url in cfg.hub_urls():  # one announcer per hub (HA: every hub dials us)
            await nursery.start(announce_loop, hclient, hub_url, cfg.auth.node_token_for(name),
                                Announce(name=name, url=url), cfg.node.announce_seconds)
        if reloads is not None:
            nursery.start_soon(apply_reloads, keeper, engine, reloads, limits)
        log.info("node %s up: engine %s, reachable at %s%s", name, cfg.engine.kind, url,
                 f", announcing to {cfg.hub.url}" if cfg.hub.url else ", waiting to be dialled")
        task_status.started((host, port))

        await stop.wait()
        log.info("node %s draining: %d request(s) in flight, up to %g s", name,
                 keeper.in_flight_total,
                 cfg.node.drain_seconds)
        keeper.drain()
        api_stop.set()
        await api_done.wait()
        nursery.cancel_scope.cancel()
        with trio.move_on_after(POOL_CLOSE_SECONDS, shield=True):
            await app.aclose()
        if tracing is not None:  # the last spans out, bounded
            with trio.move_on_after(trace.SHUTDOWN_SECONDS + 1, shield=True):
                await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)


# --- the process: signals, systemd, exit code ----------------------------------------------


async def _signals(stop: trio.Event, notifier: sdnotify.Notifier, env_file: str | None,
                   reload_send: trio.MemorySendChannel[Config]) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for sig in signals:
            if sig == signal.SIGHUP:
                notifier.reloading()
                log.info("SIGHUP: re-reading %s", env_file or "the environment")
                try:
                    reload_send.send_nowait(config_mod.load(env_file=env_file))
                    for line in config_mod.node_deprecations(env_file=env_file):
                        log.warning("%s", line)
                except config_mod.ConfigError as e:
                    log.error("reload refused, keeping the old configuration: %s", e)
                except trio.WouldBlock:
                    log.warning("a reload is already pending; this SIGHUP is folded into it")
                notifier.ready()
                continue
            log.info("%s: stopping", signal.Signals(sig).name)
            notifier.stopping()
            stop.set()
            return


async def _main(cfg: Config, env_file: str | None) -> None:
    notifier = sdnotify.Notifier.from_env()
    heartbeat = sdnotify.Liveness(max_age=3 * cfg.node.heartbeat_seconds)
    stop, node_done = trio.Event(), trio.Event()
    # One pending reload is enough: a second SIGHUP before it is applied reads the same file.
    reload_send, reload_recv = trio.open_memory_channel[Config](1)

    async def node_task(*, task_status: Bound = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await run_node(cfg, stop, reloads=reload_recv, task_status=task_status)
        finally:
            node_done.set()

    async with reload_send, trio.open_nursery() as nursery:
        # Signals first: a SIGTERM while the engine starts must still drain, not kill.
        nursery.start_soon(_signals, stop, notifier, env_file, reload_send)
        await nursery.start(node_task)
        notifier.ready()
        # What startup made lives as long as the process: full collections need not walk it
        # (each walked the whole heap, paid by the requests that allocate: spans most).
        gc.freeze()
        nursery.start_soon(sdnotify.beat_loop, heartbeat, cfg.node.heartbeat_seconds)
        nursery.start_soon(sdnotify.watchdog_loop, notifier, heartbeat)
        await node_done.wait()
        nursery.cancel_scope.cancel()


def main(cfg: Config, env_file: str | None = None) -> int:
    # httpx logs every request at INFO; the engine adapters poll, so that is noise.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    for line in config_mod.node_deprecations(env_file=env_file):
        log.warning("%s", line)
    trio.run(_main, cfg, env_file)
    return 0
