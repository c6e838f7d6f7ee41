"""A labelled metric's children, looked up once: the request path's counters and histograms.

Theory of operation: prometheus-client's `metric.labels(*values)` checks the values,
turns them into strings and takes the metric's lock on every call -- a few microseconds,
three or four times per request on the hub. A `Children` remembers the child for each
tuple of values it was asked for, so the request path pays one dict lookup. It holds no
more entries than the metric has series, and the values reaching it are already bounded
(bounds.py: known models or `other`, configured clients, a few statuses). Only for
metrics whose children are never removed (a `clear()` or `remove()` would leave a
remembered child counting into nothing).
"""

from __future__ import annotations

from typing import Any


class Children:
    __slots__ = ("_metric", "_children")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        """The child for `values`, the same one `metric.labels(*values)` gives."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
