"""What a client-chosen string may cost us, shared by hub and node.

Theory of operation: a name a client sends (a model, a node name) reaches three places
that outlive the request -- error messages, audit lines and metric labels. A label value
makes a series for as long as the process lives, so only names the process knows become
labels (models in the catalog or on a node, configured client names); everything else is
counted under `OTHER_LABEL`. Echoed text is cut to `ECHO_CHARS`, so a 100 KB name costs
a 100 KB request, not a 100 KB answer and a 100 KB audit line. `CLEANUP_SECONDS` bounds
the shielded cleanup after a cancel. `Children` remembers a labelled metric's child per
tuple of (bounded) label values, so the request path pays a dict lookup instead of
prometheus-client's `labels()` (its checks and lock). This module decides nothing else and
imports no role.
"""

from __future__ import annotations

from typing import Any

# A model or node name an operator would read is well under 200 characters (Ollama tags
# are name:tag, Hugging Face repos owner/name); longer ones are cut with "...".
ECHO_CHARS = 200
# A request's path repeated in an error message or a log line (issue 22: a 20 KB target was
# echoed whole): no route here is longer than a few dozen characters.
PATH_ECHO = 200
# The one label value for every name the process does not know.
OTHER_LABEL = "other"
# A shielded cleanup after a cancel (closing an upstream answer, revoking an etcd lease) is
# one write on loopback or a LAN: a second is plenty, and a shield must never wait forever.
CLEANUP_SECONDS = 1.0


def echo_path(path: str) -> str:
    """A request's path as an error message or a log line repeats it."""
    return echo(path, PATH_ECHO)


def echo(text: str, n: int = ECHO_CHARS) -> str:
    """`text`, cut to `n` characters (with "..." when it was cut)."""
    return text if len(text) <= n else text[:n] + "..."


class Children:
    """A labelled metric's children, looked up once (only for metrics whose children are
    never removed: a `clear()` or `remove()` would leave a remembered child counting into
    nothing). It holds no more entries than the metric has series."""

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
