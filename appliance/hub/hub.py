"""The hub's parts in one object, as the request handlers, the workers and the entry
point (hub/run.py) see them.

Theory of operation: `Hub(cfg, nursery)` builds the registry, metrics, audit
log, admission, control plane, startup grace and the page's memory; `run_hub` (hub/run.py)
makes one and starts its loops. The handlers in hub/api/ read it; nothing here runs a task
but the per-node supervisors `add_node` starts. `hub_limits`, `auth_headers`
and `client_ssl` are what every hub process (the main one and each worker)
derives from the configuration the same way.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import httpx
import trio
from prometheus_client import CollectorRegistry

from appliance.client.upstream import Pool
from appliance.config import Config
from appliance.hub.api.relay import LocalRelay
from appliance.hub.api.request import Recorder
from appliance.hub.api.router import Routing
from appliance.hub.decide.admission import Admission
from appliance.hub.decide.control import Control
from appliance.hub.decide.grace import StartupGrace
from appliance.hub.decide.limits import Limiter
from appliance.hub.fleet.nodes import Flag, NodeHandle, Registry
from appliance.hub.fleet.supervisor import supervise
from appliance.hub.observe import queue_metrics
from appliance.hub.observe.audit import AuditLog, Recent, SlowRequests
from appliance.hub.observe.fleet_metrics import ControlCollector
from appliance.hub.observe.history import History
from appliance.hub.observe.metrics import HubMetrics
from appliance.hub.observe.replica_metrics import ReplicaCollector
from appliance.observe import trace
from appliance.server.limits import Limits, LiveLimits

MiB = 1024 * 1024
# A multipart upload's own bytes around the file: boundaries, part heads, small fields.
UPLOAD_SLACK = 64 * 1024

if TYPE_CHECKING:
    from appliance.hub.cluster.member import Member
    from appliance.hub.store.responses import Background
    from appliance.hub.store.runner import Batches
    from appliance.hub.store.store import Store
    from appliance.hub.workers.workerset import WorkerSet


class Hub:
    """Everything a request handler needs, in one place."""

    def __init__(self, cfg: Config, nursery: trio.Nursery,
                 beat: Callable[[], None] = lambda: None) -> None:
        """`beat`: called at every turn of the control loop (systemd's watchdog)."""
        self.cfg = cfg
        self.limits = LiveLimits(hub_limits(cfg))  # every listener of this process (reload)
        # The one client to the nodes (token, TLS): requests, control calls, watch streams.
        self.upstream = Pool(headers=auth_headers(cfg), ssl_context=client_ssl(cfg))
        self.nursery = nursery
        self.registry = Registry()
        self.metrics_registry = CollectorRegistry()
        self.metrics = HubMetrics(self.metrics_registry, self.registry)
        self.before_scrape = [self.metrics.refresh]
        self.audit = AuditLog(cfg.audit.path, cfg.audit.max_bytes, cfg.audit.backups)
        self.audit.on_error = self.metrics.audit_write_errors.inc
        self.admission = Admission(cfg, self.registry)
        queue_metrics.register(self.metrics_registry, self.admission)
        # Per-key limits; with several hubs each enforces its share (hubs alive).
        self.tenants = Limiter(cfg.auth.clients, cfg.auth.reserve_output_tokens, self.hubs_alive)
        self.control = Control(cfg, self.registry, self.upstream, self.audit, beat=beat)
        self.admission.demand = self.control.core.demand  # replicas follow demand (demand.py)
        self.registry.health_listeners.append(self._replica_health)
        self.metrics_registry.register(ReplicaCollector(self.registry))
        self.metrics_registry.register(ControlCollector(self.control))
        # Set when Hub__DrainSeconds ran out after a stop: every running stream ends with
        # a `shutting_down` error event and a proper end, before the server cancels.
        self.drain_over = Flag()  # nodes.Flag: streams are cut by it without a task each
        self.grace = StartupGrace(self.registry, cfg.node.heartbeat_seconds)
        # The page's memory (history.py): 15 minutes of counters, the last request records.
        self.history = History()
        self.recent = Recent()
        self.slow = SlowRequests()  # the hour's slowest ("why slow")
        # OpenTelemetry while OTEL_EXPORTER_OTLP_ENDPOINT is set (observe/trace.py), else None.
        self.tracing = trace.setup("appliance-hub")
        if self.tracing is not None:
            self.metrics_registry.register(trace.DroppedCollector(self.tracing))
        # The request path's parts, built once (hub/api/router.py).
        self.relay = LocalRelay(self.upstream, cfg.hub.upstream_read_seconds, self.drain_over)
        self.routing = Routing(
            cfg.auth, cfg.hub.max_body_bytes, self.tenants, self.control, self.admission,
            self.grace, Recorder(self.audit, self.recent, self.slow, self.metrics,
                                 self.admission.enabled),
            self.relay, self.tracing)
        # with Cluster__Etcd (run_hub sets both): the member, and the one client that asks
        # the other hubs for the objects they hold (hub/store/peers.py)
        self.cluster: Member | None = None
        self.peer_client: httpx.AsyncClient | None = None
        # with Hub__Workers>1 (hub/workers.py sets it)
        self.workers: WorkerSet | None = None
        # with Store__Path (run_hub opens it; hub/store/): files, batches, stored responses
        self.store: Store | None = None
        self.batches: Batches | None = None
        self.background: Background | None = None  # background: true responses

    def hubs_alive(self) -> int:
        """Hubs in the cluster view (this one counted), 1 without a cluster."""
        if self.cluster is None:
            return 1
        return len(set(self.cluster.snapshot.hubs) | {self.cluster.name})

    def add_node(self, name: str, url: str, static: bool) -> None:
        per_node = {c.name: c.token for c in self.cfg.auth.nodes}
        h, new = self.registry.upsert(name, url, static, per_node.get(name, ""))
        if new:
            self.audit.event("node_added", node=name, url=url, static=static)
            self.nursery.start_soon(partial(
                supervise, self.upstream, h, self.registry,
                heartbeat=self.cfg.node.heartbeat_seconds,
                backoff_max=self.cfg.hub.reconnect_max_seconds,
                on_event=self._node_event,
                forget_after=self.cfg.hub.forget_node_seconds,
            ))

    def _node_event(self, kind: str, h: NodeHandle, reason: str) -> None:
        self.audit.event(kind, node=h.name, url=h.url, reason=reason)

    def _replica_health(self, h: NodeHandle, model: str, why: str) -> None:
        """A node's probes turned a replica unhealthy (`why`) or healthy again ("")."""
        if why:
            self.audit.event("replica_unhealthy", node=h.name, model=model, reason=why)
            self.control.replica_failed(model, h.name, why)
        else:
            self.audit.event("replica_healthy", node=h.name, model=model)

    def reload(self, cfg: Config) -> None:
        self.cfg = cfg
        self.limits.set(hub_limits(cfg))
        self.admission.reload(cfg)
        self.tenants.configure(cfg.auth.clients, cfg.auth.reserve_output_tokens)
        self.routing.configure(cfg)
        self.routing.recorder.priority_on = self.admission.enabled
        self.relay.read_seconds = cfg.hub.upstream_read_seconds
        self.control.reload(cfg)
        for n in cfg.nodes:
            self.add_node(n.name, n.url, static=True)
        if self.store is not None:  # its bounds follow; Store__Path only at the next start
            self.store.reload(cfg.store)
        if self.batches is not None:
            self.batches.limiter.total_tokens = cfg.batch.max_concurrent
        if self.background is not None:
            self.background.limiter.total_tokens = cfg.batch.max_concurrent
        if self.workers is not None:
            self.workers.reload()  # each worker re-reads it (hub/worker.py)


def hub_limits(cfg: Config) -> Limits:
    h = cfg.hub
    # A file upload is streamed to disk (hub/api/files.py): its bound is the store's.
    uploads = frozenset({b"/v1/files"}) if cfg.store.path else frozenset()
    return Limits(h.header_read_seconds, h.body_read_seconds, h.max_connections,
                  h.max_buffered_bytes, h.max_body_bytes, h.write_stall_seconds,
                  uploads, cfg.store.max_file_mb * MiB + UPLOAD_SLACK,
                  min_read_bytes_per_second=h.min_read_bytes_per_second)


def auth_headers(cfg: Config) -> dict[str, str]:
    return {"authorization": f"Bearer {cfg.auth.node_token}"} if cfg.auth.node_token else {}


def client_ssl(cfg: Config) -> ssl.SSLContext | None:
    """Verify nodes with Hub__TlsCa and present our certificate; None: system defaults."""
    if not cfg.hub.tls_ca:
        return None
    ctx = ssl.create_default_context(cafile=cfg.hub.tls_ca)
    if cfg.hub.tls_cert:
        ctx.load_cert_chain(cfg.hub.tls_cert, cfg.hub.tls_key or None)
    return ctx
