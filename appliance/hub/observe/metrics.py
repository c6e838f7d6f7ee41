"""The hub's request and node series on its own CollectorRegistry.

Theory of operation: request series are updated on the request path (a label lookup,
remembered by `Children`, and an add); node series are derived from the registry at each
scrape (`refresh`, a before-scrape hook), so they can never go stale and cost nothing
between scrapes. Other parts (admission, control) register their own series on the same
registry.
"""

from __future__ import annotations

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from appliance.bounds import Children
from appliance.hub.fleet.nodes import Registry

# Buckets from 5 ms (a proxied short answer) to 5 min (a long generation).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class HubMetrics:
    def __init__(self, registry: CollectorRegistry, nodes: Registry) -> None:
        self.nodes = nodes
        r = registry
        self.requests = Counter("appliance_requests",
                                "Client requests by client, model and status.",
                                ["client", "model", "status"], registry=r)
        self.latency = Histogram("appliance_request_duration_seconds",
                                 "Request duration, first byte in to last byte out.",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("appliance_time_to_first_byte_seconds",
                              "Time to the first response byte.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        # client: a configured client's name or "anonymous" (bounded); kind: input | output.
        self.tokens = Counter("appliance_tokens",
                              "Tokens by client, model and kind (input, output): the engine's "
                              "usage, else the hub's estimate.",
                              ["client", "model", "kind"], registry=r)
        self.in_flight = Gauge("appliance_in_flight", "Requests in flight by model.", ["model"],
                               registry=r)
        # The request path's lookups (bounds.Children): these series are never removed.
        self.requests_of = Children(self.requests)
        self.latency_of = Children(self.latency)
        self.ttfb_of = Children(self.ttfb)
        self.tokens_of = Children(self.tokens)
        self.in_flight_of = Children(self.in_flight)
        self.node_up = Gauge("appliance_node_up", "1 while the node is connected and up.", ["node"],
                             registry=r)
        self.node_paused = Gauge("appliance_node_paused", "1 while the node's owner paused it.",
                                 ["node"], registry=r)
        self.node_cordoned = Gauge("appliance_node_cordoned", "1 while the node is cordoned.",
                                   ["node"], registry=r)
        self.node_over = Gauge("appliance_node_over_limits",
                               "1 while the node is over its own limits.", ["node"], registry=r)
        self.node_lost = Gauge("appliance_node_lost", "1 while the node is not connected.",
                               ["node"], registry=r)
        self.audit_write_errors = Counter("appliance_audit_write_errors_total",
                                          "Audit lines that could not be written.",
                                          registry=r)
        self.node_age = Gauge("appliance_node_heartbeat_age_seconds",
                              "Seconds since the node's last watch line.",
                              ["node"], registry=r)

    def refresh(self) -> None:
        now = trio.current_time()
        # Rebuilt at each scrape: a forgotten node's series go with it.
        for g in (self.node_up, self.node_lost, self.node_paused, self.node_cordoned,
                  self.node_over, self.node_age):
            g.clear()
        for h in list(self.nodes.nodes.values()):
            st = h.status()
            self.node_up.labels(h.name).set(1 if st == "up" else 0)
            self.node_lost.labels(h.name).set(1 if st == "lost" else 0)
            self.node_paused.labels(h.name).set(1 if st == "paused" else 0)
            self.node_cordoned.labels(h.name).set(1 if h.cordoned else 0)
            self.node_over.labels(h.name).set(1 if h.state is not None and h.state.over_limits
                                              else 0)
            if h.last_line:
                self.node_age.labels(h.name).set(round(now - h.last_line, 3))
