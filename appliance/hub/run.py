"""The hub process: one nursery holding every long-lived part.

Theory of operation (DESIGN 1): `run_hub` opens the node client, the registry, the
control plane and admission, then starts with `nursery.start` the API server, the
metrics server, the control loop and one supervisor per static node; announced nodes
get theirs as they arrive. `task_status.started` hands back the bound API address only
once all of it listens. A stop (SIGTERM/SIGINT, or the caller's `stop` event) makes the
API server stop accepting and drain for `Hub__DrainSeconds` (a hub in a cluster hands
its leadership over first: `Member.resign`), then cancels the rest; the exit code is 0.
SIGHUP re-reads the env file; a bad one is refused with one log line and the old
configuration stays. The listeners' limits (`Hub.limits`, appliance/server/limits.py's
`LiveLimits`) follow a reload for new connections and requests, in every hub process.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import TYPE_CHECKING

import trio

from appliance import config as config_mod
from appliance.config import Config
from appliance.hub.api.app import make_app
from appliance.hub.hub import Hub
from appliance.hub.observe.audit import check_path
from appliance.hub.observe.history import read_hub, run_sampler
from appliance.hub.workers import pool as workers
from appliance.observe import trace
from appliance.server.serve import Bound, same_port, serve

if TYPE_CHECKING:
    from appliance.observe import sdnotify

log = logging.getLogger(__name__)

HUB_METRICS_DEFAULT = "0.0.0.0:9464"
# After the drain runs out, the time streams get to send their error event and end before
# the server cancels what is left: one write each, on loopback or a LAN.
DRAIN_CUT_SECONDS = 2.0
# Closing the request path's pool at exit: each idle connection's close, on a LAN.
POOL_CLOSE_SECONDS = 2.0


# What `run_hub` hands to `nursery.start`: the hub and its bound address.
HubStarted = trio.TaskStatus[tuple[Hub, tuple[str, int]]]


async def run_hub(cfg: Config, stop: trio.Event, *, env_file: str | None = None,
                  beat: Callable[[], None] = lambda: None,
                  task_status: HubStarted = trio.TASK_STATUS_IGNORED) -> None:
    """`beat`: called at every turn of the control loop (feeds systemd's watchdog)."""
    async with trio.open_nursery() as nursery:
        hub = Hub(cfg, nursery, beat)
        metrics_listen = HUB_METRICS_DEFAULT if cfg.metrics.listen is None else cfg.metrics.listen
        same_port(metrics_listen, cfg.hub.listen, "Hub__Listen")
        if not cfg.auth.node_token and not cfg.auth.nodes:
            log.warning(
                "Auth__NodeToken is empty: this hub accepts no node announcements (static nodes "
                        "only); set Auth__NodeToken on the hub and its nodes to let nodes announce "
                        "themselves")
        if cfg.cluster.etcd:
            await nursery.start(_cluster, hub)
        await nursery.start(hub.control.run)
        await nursery.start(_store, hub)
        await nursery.start(run_sampler, hub.history, partial(read_hub, hub.metrics, hub.admission,
                                                              hub.registry))
        api_done = trio.Event()

        async def drain_deadline() -> None:
            await stop.wait()
            if hub.cluster is not None:  # another hub leads now, not when our lease runs out
                hub.cluster.resign()
            await trio.sleep(cfg.hub.drain_seconds)
            hub.drain_over.set()

        nursery.start_soon(drain_deadline)
        nursery.start_soon(hub.upstream.sweep_every)  # idle node connections closed promptly

        shared = None
        if cfg.hub.workers > 1:  # hub/workers.py: one listener, N-1 relay workers
            shared, where = workers.bind_listener(cfg.hub.listen), workers.private_dir()
            nursery.start_soon(partial(serve, make_app(hub), cfg.hub.listen, "hub",
                                       bind=f"unix:{where}/http.sock", announce=False,
                                       shutdown_trigger=stop.wait, limits=hub.limits))
            await nursery.start(workers.serve_leases, hub, f"{where}/lease.sock")

        async def api_server(*, task_status: Bound = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve(make_app(hub), cfg.hub.listen, "hub", shutdown_trigger=stop.wait,
                            limits=hub.limits,
                            drain_seconds=cfg.hub.drain_seconds + DRAIN_CUT_SECONDS,
                            certfile=cfg.hub.tls_cert,
                            keyfile=cfg.hub.tls_key, ca_certs=cfg.hub.tls_ca,
                            bind=f"fd://{shared.fileno()}" if shared is not None else "",
                            task_status=task_status)
            finally:
                api_done.set()

        addr = await nursery.start(api_server)
        if hub.cluster is not None:  # the other hubs ask this one for the objects it holds
            from appliance.hub.store.peers import own_url

            hub.cluster.advertise(own_url(cfg, addr))
        if shared is not None:
            await nursery.start(workers.start_workers, hub, cfg.hub.workers, shared.fileno(),
                                where, env_file)
            nursery.start_soon(workers.drain_workers, stop, hub.workers)
        if metrics_listen:
            from appliance.observe.metricsapp import metrics_app

            await nursery.start(partial(serve, metrics_app(hub.metrics_registry, hub.before_scrape),
                                        metrics_listen, "metrics", shutdown_trigger=stop.wait,
                                        drain_seconds=1,
                                        limits=hub.limits))
        for n in cfg.nodes:
            hub.add_node(n.name, n.url, static=True)
        task_status.started((hub, addr))
        try:
            await api_done.wait()
        finally:
            if shared is not None:
                with trio.CancelScope(shield=True):
                    await workers.reap_workers(hub.workers, where, cfg.hub.drain_seconds
                                               + DRAIN_CUT_SECONDS + workers.STOP_SECONDS)
        nursery.cancel_scope.cancel()
        with trio.move_on_after(POOL_CLOSE_SECONDS, shield=True):
            await hub.upstream.aclose()
        if hub.tracing is not None:  # the last spans out, bounded (observe/trace.py)
            with trio.move_on_after(trace.SHUTDOWN_SECONDS + 1, shield=True):
                await trio.to_thread.run_sync(hub.tracing.shutdown, abandon_on_cancel=True)


async def _store(hub: Hub, *,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Store__Path: files, batches, stored responses (hub/store/); batches resume here."""
    from appliance.hub.api.router import handle_inference
    from appliance.hub.store import store
    from appliance.hub.store.beside import Beside, of_admission
    from appliance.hub.store.responses import Background
    from appliance.hub.store.runner import Batches

    if not store.wanted(hub.cfg.store):  # no thread at all then (a virtual clock jumps over one)
        task_status.started()
        return
    hub.store = await trio.to_thread.run_sync(store.open_store, hub.cfg.store, hub.cfg.hub_name(),
                                              hub.metrics_registry)
    if hub.store is None:
        task_status.started()
        return
    serve = partial(handle_inference, hub.routing)
    beside = Beside(of_admission(hub.admission))  # lines step aside for other work
    hub.batches = Batches(lambda: hub.cfg, hub.store, serve, beside)
    hub.background = Background(lambda: hub.cfg, hub.store, serve, beside)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.store.sweep_every)
        await nursery.start(hub.store.behind.run)
        await nursery.start(hub.batches.run)
        await nursery.start(hub.background.run)
        task_status.started()


async def _cluster(hub: Hub, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Several hubs (Cluster__Etcd): this hub's election and shared state (hub/cluster/)."""
    from appliance.hub.cluster import etcd
    from appliance.hub.cluster.member import Member
    from appliance.hub.store import peers

    async with etcd.open_client(hub.cfg.cluster) as client, \
            peers.open_client(hub.cfg) as hub.peer_client:
        hub.cluster = Member(hub.cfg, etcd.make(hub.cfg.cluster, client), hub.control, hub.registry,
                             lambda name, url: hub.add_node(name, url, static=False))
        await hub.cluster.run(task_status=task_status)


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def handle_signals(signals: AsyncIterator[int], stop: trio.Event,
                         notifier: sdnotify.Notifier, on_reload: Callable[[], object],
                         what: str) -> None:
    """SIGHUP: `on_reload()` between RELOADING=1 and READY=1; SIGTERM/SIGINT: STOPPING=1, stop.

    `signals` comes from `trio.open_signal_receiver(*SIGNALS)`, opened before anything
    listens: a SIGTERM that arrives during start-up must drain too, not kill.
    """
    async for sig in signals:
        if sig == signal.SIGHUP:
            notifier.reloading()
            on_reload()
            notifier.ready()
            continue
        log.info("%s stopping: draining in-flight work", what)
        notifier.stopping()
        stop.set()
        return


# What a running hub cannot take: bound sockets and their TLS, the drain bound handed to
# the server, the node clients' token, the open audit file. They apply at the next start.
AT_NEXT_START: dict[str, Callable[[Config], object]] = {
    "Hub__Listen": lambda c: c.hub.listen, "Hub__TlsCert": lambda c: c.hub.tls_cert,
    "Hub__TlsKey": lambda c: c.hub.tls_key, "Hub__TlsCa": lambda c: c.hub.tls_ca,
    "Hub__DrainSeconds": lambda c: c.hub.drain_seconds,
    "Metrics__Listen": lambda c: c.metrics.listen,
    "Auth__NodeToken": lambda c: c.auth.node_token, "Audit__Path": lambda c: c.audit.path,
    "Hub__Name": lambda c: c.hub.name, "Cluster": lambda c: c.cluster,
    "Hub__Workers": lambda c: c.hub.workers, "Store__Path": lambda c: c.store.path,
}


def reload_hub(hub: Hub, env_file: str | None,
               adjust: Callable[[Config], Config] | None = None) -> Config | None:
    """One log line either way: refused (the old configuration stays), or reloaded --
    naming any changed setting that only applies at the next start. `adjust` makes the
    new Config what the caller made of the first one (`appliance up`). Returns the Config
    applied, None when refused."""
    try:
        new = config_mod.load(env_file=env_file)
        if adjust is not None:
            new = adjust(new)
    except config_mod.ConfigError as e:
        log.error("reload refused, keeping the old configuration: %s", e)
        return None
    later = [var for var, get in AT_NEXT_START.items() if get(new) != get(hub.cfg)]
    hub.reload(new)
    hub.audit.event("config_reloaded", env_file=env_file or "")
    if later:
        log.warning("configuration reloaded from %s; changed, applied only at the next start: %s",
                    env_file or "the environment", ", ".join(later))
    else:
        log.info("configuration reloaded from %s", env_file or "the environment")
    return new


async def _main(cfg: Config, env_file: str | None) -> None:
    from appliance.observe import sdnotify

    notifier = sdnotify.Notifier.from_env()
    heartbeat = sdnotify.Liveness(max_age=3 * cfg.hub.control_interval_seconds)
    stop = trio.Event()
    hub_done = trio.Event()

    async def hub_task(*, task_status: HubStarted = trio.TASK_STATUS_IGNORED) -> None:
        try:
            # the control loop's every turn feeds the watchdog
            await run_hub(cfg, stop, env_file=env_file, beat=heartbeat.beat,
                          task_status=task_status)
        finally:
            hub_done.set()

    with trio.open_signal_receiver(*SIGNALS) as signals:
        async with trio.open_nursery() as nursery:
            hub, _addr = await nursery.start(hub_task)
            notifier.ready()
            # What startup made lives as long as the process: full collections need not walk it
            # (each walked the whole heap, paid by the requests that allocate: spans most).
            gc.freeze()
            nursery.start_soon(sdnotify.watchdog_loop, notifier, heartbeat)
            nursery.start_soon(handle_signals, signals, stop, notifier, partial(reload_hub, hub,
                                                                                env_file), "hub")
            await hub_done.wait()
            nursery.cancel_scope.cancel()


def main(cfg: Config, env_file: str | None = None) -> int:
    spec = os.environ.pop(workers.WORKER_ENV, "")
    if spec:  # started by a hub with Hub__Workers>1: relay only (hub/worker.py)
        from appliance.hub.workers import worker

        return worker.main(cfg, spec, env_file)
    err = check_path(cfg.audit.path)
    if err is not None:
        print(f"appliance hub: {err}", file=sys.stderr)
        return 2
    trio.run(_main, cfg, env_file)
    return 0
