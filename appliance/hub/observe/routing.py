"""The routing series, read from the affinity core at scrape time.

Theory of operation: `appliance_routing_decisions_total{model,reason}` (reason `session`,
`prefix` or `spread`, DESIGN 9.2), and the prompt tokens the engines reported with those
they said were cached -- `appliance_prompt_tokens_total{model}` and
`appliance_cached_prompt_tokens_total{model}` -- come from `Affinity.models`, whose keys
are models the router resolved (known ones only), so the label set stays bounded. Nothing
is counted here; a scrape only reads.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from appliance.hub.decide.affinity import REASONS, Affinity


class RoutingCollector:
    def __init__(self, affinity: Affinity) -> None:
        self.affinity = affinity

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "appliance_routing_decisions",
            "Requests placed, by model and why there: session (a session key), prefix (a "
            "known prompt prefix), spread (nothing known, or affinity off).",
            labels=["model", "reason"])
        prompt = CounterMetricFamily("appliance_prompt_tokens",
                                     "Prompt tokens of answers whose engine reported its cache, "
                                     "by model.", labels=["model"])
        cached = CounterMetricFamily("appliance_cached_prompt_tokens",
                                     "Of those, the tokens the engine reported cached, by model.",
                                     labels=["model"])
        for model, s in sorted(self.affinity.models.items()):
            for reason in REASONS:
                decisions.add_metric([model, reason], getattr(s, reason))
            prompt.add_metric([model], s.prompt_tokens)
            cached.add_metric([model], s.cached_tokens)
        yield decisions
        yield prompt
        yield cached
