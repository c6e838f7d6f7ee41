"""Model health, engine installs, leadership and certificate expiry, computed at each scrape.

Theory of operation: a custom collector on the hub's registry, so every value is read from
live state when Prometheus asks, never cached between scrapes. The failure this exists to
prevent: an alert on "a model that should run has nothing ready" could never fire because
its series existed only while a replica was ready. Here every model the hub knows gets
every series, `appliance_model_ready` included, at 0 when nothing serves it; whether it
*should* run is `appliance_model_desired` (always-on replicas, or 1 for an on-demand model
that was asked for). Certificate expiry is read from disk at each scrape, so an alert fires
on the file the next start will load. This module only reports; it decides nothing.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.server.tlsinfo import cert_not_after

if TYPE_CHECKING:
    from appliance.hub.decide.control import Control

log = logging.getLogger(__name__)

_MODEL = [
    ("appliance_model_desired",
     "Replicas the model should have now (always-on count; 1 for an on-demand model asked for).",
     "desired"),
    ("appliance_model_ready", "Ready replicas of the model; 0 while nothing serves it.", "ready"),
    ("appliance_model_consecutive_start_failures",
     "Start failures of the model in a row (a success resets it).",
     "consecutive_start_failures"),
    ("appliance_model_parked", "1 while the model is parked after repeated start failures.",
     "parked"),
    ("appliance_model_unplaceable", "1 while the model fits on no node.", "unplaceable"),
]


class ControlCollector:
    def __init__(self, control: Control) -> None:
        self.control = control
        self._logged: dict[str, str] = {}  # path -> the error last logged (once per change)

    def describe(self) -> list[Metric]:
        return self._families()[0]

    def _families(self) -> tuple[list[Metric], list[GaugeMetricFamily], GaugeMetricFamily,
                                 tuple[GaugeMetricFamily, CounterMetricFamily,
                                       GaugeMetricFamily], GaugeMetricFamily]:
        model = [GaugeMetricFamily(n, h, labels=["model"]) for n, h, _ in _MODEL]
        engine = GaugeMetricFamily("appliance_node_engine_info",
                                   "Engine installs per node (kind, version); value 1.",
                                   labels=["node", "kind", "version"])
        leader = GaugeMetricFamily("appliance_leader",
                                   "1 while this hub leads the fleet (a single hub always does).",
                                   labels=["hub"])
        changes = CounterMetricFamily("appliance_leader_changes_total",
                                      "Leader changes this hub has seen (epochs).")
        up = GaugeMetricFamily("appliance_cluster_up",
                               "1 while etcd answers this hub (always 1 for a hub alone).")
        tls = GaugeMetricFamily("appliance_tls_cert_expiry_seconds",
                                "notAfter of the certificate file, as Unix time, read from disk at "
                                "each scrape.",
                                labels=["path"])
        # A node refusing the epoch of the leader etcd confirms (HA fencing); node names are
        # bounded by Hub__MaxNodes.
        fenced = GaugeMetricFamily("appliance_node_fenced",
                                   "1 while the node refuses this leading hub's epoch.",
                                   labels=["node"])
        return ([*model, engine, leader, changes, up, tls, fenced], model, engine,
                (leader, changes, up), tls)

    def collect(self) -> list[Metric]:
        fams, model, engine, cluster_fams, tls = self._families()
        fenced = fams[-1]
        assert isinstance(fenced, GaugeMetricFamily)
        for st in self.control.models_status():
            for fam, (_, _, key) in zip(model, _MODEL, strict=True):
                fam.add_metric([st["name"]], float(st[key]))
        for h in self.control.registry.nodes.values():
            if h.state is not None and not h.removed:
                for e in h.state.engines:
                    engine.add_metric([h.name, e.kind, e.version], 1.0)
            if not h.removed:
                fenced.add_metric([h.name], 1.0 if h.fenced else 0.0)
        leader, changes, up = cluster_fams
        cluster = self.control.cluster
        leader.add_metric([self.control.cfg.hub_name()], 1.0 if self.control.leading() else 0.0)
        changes.add_metric([], float(cluster.changes if cluster is not None else 0))
        up.add_metric([], 1.0 if cluster is None or cluster.up else 0.0)
        hub = self.control.cfg.hub
        for path in dict.fromkeys(p for p in (hub.tls_cert, hub.tls_ca) if p):
            try:
                tls.add_metric([path], cert_not_after(path))
            except (OSError, ValueError) as e:
                if self._logged.get(path) != str(e):
                    log.warning("certificate %s unreadable, no expiry series for it: %s", path, e)
                    self._logged[path] = str(e)
            else:
                self._logged.pop(path, None)
        return fams
