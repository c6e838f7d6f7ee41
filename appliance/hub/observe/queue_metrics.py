"""Admission's series, read from its core at scrape time (decide/ imports no prometheus_client).

`appliance_queue_{waiting,timeouts_total,rejected_total}{model}` always;
`appliance_priority_reserve_slots` and `appliance_priority_*{class}` only while priority
is on, so with it off the scrape is exactly what it was without the feature; the routing
series (routing.py) of admission's affinity core; its home waits (home.py). Nothing is counted here.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from appliance.hub.decide.admission import Admission
from appliance.hub.decide.lanes import CLASSES
from appliance.hub.decide.priority import AdmissionCore
from appliance.hub.observe.home import HomeWaitCollector
from appliance.hub.observe.routing import RoutingCollector


def register(metrics: CollectorRegistry, admission: Admission) -> None:
    """Admission's collectors (queue, priority, routing) into `metrics`."""
    metrics.register(QueueCollector(admission.core))
    metrics.register(PriorityCollector(admission))
    metrics.register(RoutingCollector(admission.affinity))
    metrics.register(HomeWaitCollector(admission.cost.queues))


class QueueCollector:
    """`appliance_queue_*{model}`, read from the core at scrape time."""

    def __init__(self, core: AdmissionCore) -> None:
        self.core = core

    def collect(self) -> Iterator[Metric]:
        waiting = GaugeMetricFamily("appliance_queue_waiting",
                                    "Requests waiting for admission, by model.",
                                    labels=["model"])
        timeouts = CounterMetricFamily("appliance_queue_timeouts",
                                       "Waits for admission that ran out (503), by model.",
                                       labels=["model"])
        rejected = CounterMetricFamily("appliance_queue_rejected",
                                       "Requests refused at once because "
                                       "Queue__MaxDepth requests already waited (queue_full), by "
                                       "model.",
                                       labels=["model"])
        for model, s in sorted(self.core.models.items()):
            waiting.add_metric([model], s.waiting)
            timeouts.add_metric([model], s.timeouts)
            rejected.add_metric([model], s.full)
        yield waiting
        yield timeouts
        yield rejected


class PriorityCollector:
    """`appliance_priority_*`, only while priority is on (read at each scrape, so a reload
    turns them on and off)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.core = admission.core

    def collect(self) -> Iterator[Metric]:
        if not self.admission.enabled:
            return
        yield GaugeMetricFamily("appliance_priority_reserve_slots",
                                "Free places background work may not take "
                                "(Priority__ReserveSlots).",
                                value=self.core.reserve)
        waiting = GaugeMetricFamily("appliance_priority_waiting", "Requests waiting now, by class.",
                                    labels=["class"])
        held = CounterMetricFamily("appliance_priority_held",
                                   "Requests that had to wait, by class.", labels=["class"])
        released = CounterMetricFamily("appliance_priority_released",
                                       "Waiting requests that went, by class.",
                                       labels=["class"])
        timed_out = CounterMetricFamily("appliance_priority_timed_out",
                                        "Waits that ran out (503), by class.",
                                        labels=["class"])
        requests = CounterMetricFamily("appliance_priority_requests",
                                       "Requests admitted or refused, by class.",
                                       labels=["class"])
        for c in CLASSES:
            s = self.core.classes[c]
            waiting.add_metric([c], s.waiting)
            held.add_metric([c], s.held)
            released.add_metric([c], s.released)
            timed_out.add_metric([c], s.timed_out)
            requests.add_metric([c], s.requests)
        yield from (waiting, held, released, timed_out, requests)
