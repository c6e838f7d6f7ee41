"""Replica health as the nodes' generation probes say it, computed at each scrape.

Theory of operation: a custom collector on the hub's registry reading the registry's node
states when Prometheus asks. `appliance_replica_healthy{node,model}` is 1 or 0 for every
ready replica on a connected node (0: the node says it does not generate, node/health.py);
`appliance_probe_failures_total{node,model}` is the node's own count of failed probes,
passed on as a counter (it restarts at 0 with the node, as counters do). Node and model
names are bounded by Hub__MaxNodes and the models a node lists. It only reports.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.hub.fleet.nodes import Registry
from appliance.wire import UNHEALTHY


class ReplicaCollector:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def describe(self) -> list[Metric]:
        return list(self._families())

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily]:
        return (GaugeMetricFamily("appliance_replica_healthy",
                                  "1 while a ready replica generates as its node's probes find; "
                                  "0 while the node says it is unhealthy.",
                                  labels=["node", "model"]),
                CounterMetricFamily("appliance_probe_failures",
                                    "Generation probes of the model that failed on the node "
                                    "(as the node counts them since it started).",
                                    labels=["node", "model"]))

    def collect(self) -> list[Metric]:
        healthy, failures = self._families()
        for h in self.registry.nodes.values():
            if h.removed or h.state is None:
                continue
            for m in h.state.models:
                if h.connected and m.state == "ready":
                    healthy.add_metric([h.name, m.name], 0.0 if m.health == UNHEALTHY else 1.0)
                if m.probe_failures:
                    failures.add_metric([h.name, m.name], float(m.probe_failures))
        return [healthy, failures]
