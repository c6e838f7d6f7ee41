"""`appliance_home_waits_total{model,outcome}`, read from the home queues at scrape time.

Theory of operation: requests that waited for a place on the node holding their prompt
(decide/home.py), by what became of the wait: `home`, `moved`, `sent`, `cancelled`. Its
models are those the router resolved (known ones), so the label set stays bounded.
Nothing is counted here; a scrape only reads.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from appliance.hub.decide.home import HomeQueues


class HomeWaitCollector:
    def __init__(self, queues: HomeQueues) -> None:
        self.queues = queues

    def collect(self) -> Iterator[Metric]:
        waits = CounterMetricFamily(
            "appliance_home_waits",
            "Requests that waited for a place on the node holding their prompt, by model and "
            "outcome: home (got it), moved (Router__HomeWaitSeconds passed: went elsewhere), "
            "sent (passed, nowhere else: sent home anyway), cancelled (the client hung up).",
            labels=["model", "outcome"])
        for (model, outcome), n in sorted(self.queues.outcomes.items()):
            waits.add_metric([model, outcome], n)
        yield waits
