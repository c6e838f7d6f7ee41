"""One proxied request on the node, as the hub's `Request` is one on the hub.

Theory of operation: `NodeRequest(keeper, metrics, model)` is made once the body names its
model. `start()` takes its place among the node's in-flight requests (Node__MaxConcurrency,
Node__ModelSlots) or raises the keeper's `NoPlace` saying why not; whoever answers sets
`status` (the label of `appliance_node_requests_total`: an HTTP status, or `engine_error`
when an answer broke off) just before the last byte. `finish(otherwise)` -- in a
`finally` -- gives the place back and counts the request, exactly once; a request that
ended with no status is counted under `otherwise` (`client_gone`, `cancelled`).
"""

from __future__ import annotations

import time
from typing import Any

from appliance.bounds import OTHER_LABEL
from appliance.node.metrics import NodeMetrics
from appliance.node.state import NodeStateKeeper


class NodeRequest:
    __slots__ = ("keeper", "metrics", "model", "label", "status", "started", "done", "sent_type",
                 "span", "t0")

    def __init__(self, keeper: NodeStateKeeper, metrics: NodeMetrics | None, model: str) -> None:
        self.keeper, self.metrics, self.model = keeper, metrics, model
        self.label = model  # the metric label: a name the node does not know is OTHER_LABEL
        self.status: str | None = None
        self.started = False
        self.done = False
        # The content type of the head sent to the client; None while none went out.
        self.sent_type: str | None = None
        self.span: Any = None  # its OpenTelemetry span while the node traces (proxy.py)

    def unknown_model(self) -> None:
        """The model is not on this node: a client-chosen name never becomes a label."""
        self.label = OTHER_LABEL

    def start(self) -> None:
        """Take a place among the node's in-flight requests; raises NoPlace (why not)."""
        self.keeper.try_start(self.model)
        self.started = True
        self.t0 = time.monotonic()

    def finish(self, otherwise: str) -> None:
        """Give the place back and count the request; once (later calls do nothing)."""
        if self.done:
            return
        self.done = True
        if self.started:
            self.keeper.finish(self.model)
            if self.status == "200" and self.keeper.watchers > 1:  # several hubs (HA)
                self.keeper.served(self.model, time.monotonic() - self.t0)
        if self.metrics is not None:
            self.metrics.request(self.label, self.status or otherwise)
