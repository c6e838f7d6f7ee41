"""The node's own series on its own CollectorRegistry.

Theory of operation: requests are counted on the request path (a label lookup and an
add); everything else is derived from the state keeper at each scrape (`refresh`, a
before-scrape hook), so it can never go stale. The names start `appliance_node_` and
never repeat a hub series: the hub publishes its view of every node (`appliance_node_up`,
`_paused`, `_over_limits`, labelled by node), the node its own, unlabelled by node
(Prometheus adds the instance).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from appliance.bounds import Children
from appliance.node.state import NodeStateKeeper


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry, keeper: NodeStateKeeper) -> None:
        self.keeper = keeper
        self.registry = registry
        r = registry
        self.requests = Counter("appliance_node_requests",
                                "Requests proxied to the engine, by model and status.",
                                ["model", "status"], registry=r)
        self._requests_of = Children(self.requests)  # never removed: remembered children
        self.in_flight = Gauge("appliance_node_in_flight",
                               "Requests in flight on this node, by model.",
                               ["model"], registry=r)
        self.paused = Gauge("appliance_node_owner_paused",
                            "1 while the owner has paused this node.", registry=r)
        self.left = Gauge("appliance_node_left_fleet",
                          "1 while the owner has taken this node out of the fleet.",
                          registry=r)
        self.over = Gauge("appliance_node_over_own_limits",
                          "1 while this node is over its declared limits.",
                          registry=r)
        self.mem_total = Gauge("appliance_node_memory_total_mib",
                               "Memory for models, MiB (measured or declared).",
                               registry=r)
        self.mem_used = Gauge("appliance_node_memory_used_mib",
                              "Memory used, MiB (measured or the engine's account).",
                              registry=r)

    def request(self, model: str, status: str) -> None:
        self._requests_of(model, status).inc()

    def refresh(self) -> None:
        st = self.keeper.snapshot()
        self.in_flight.clear()
        for m in st.models:
            self.in_flight.labels(m.name).set(m.in_flight)
        for name, n in self.keeper.in_flight.items():
            self.in_flight.labels(name).set(n)
        self.paused.set(1 if st.paused else 0)
        self.left.set(1 if st.left else 0)
        self.over.set(1 if st.over_limits else 0)
        self.mem_total.set(st.memory_total_mb or 0)
        self.mem_used.set(st.memory_used_mb or 0)
