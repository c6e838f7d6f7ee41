"""What a node needs from an engine, whatever its kind.

Theory of operation: an engine adapter owns the engine's processes or connection and
knows which models exist, which are loaded, and where each loaded model is served (a
base URL on loopback or the upstream). It never counts requests or enforces limits --
the node does that -- and it never proxies bytes: the node streams to `upstream(model)`.
It tells the node about every change through the `on_change` callback its constructor was
given, so the node can publish a new `NodeState` on its watch stream.
"""

from __future__ import annotations

import abc
import urllib.parse
from collections.abc import Callable

import trio

from appliance.wire import EngineInstall, ModelState

Changed = Callable[[], None]


def unheard() -> None:
    """No one listens (an engine built alone, in a test)."""


def redacted(text: str, url: str) -> str:
    """`text` with the engine's address (`url`, its host:port, its host) written as "the
    engine": an error a client reads names no address behind the node; the log keeps it."""
    parts = urllib.parse.urlsplit(url)
    for form in (url.rstrip("/"), parts.netloc, parts.hostname or ""):
        if form:
            text = text.replace(form, "the engine")
    return text


class EngineError(Exception):
    """A load or unload the engine refused; the message is the engine's own words."""


class Engine(abc.ABC):
    kind: str = ""
    # The node runs the engine's processes itself and may restart one (`restart`).
    restartable: bool = False

    def __init__(self, on_change: Changed = unheard) -> None:
        self.on_change = on_change

    @abc.abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Long-lived: start or connect to the engine, keep the model list fresh.

        Calls `task_status.started()` once the engine answers (or is known absent,
        with that said in `installs()`/`models()`), then runs until cancelled.
        Engine processes it started die with it (and with the node, even on SIGKILL).
        """

    @abc.abstractmethod
    def installs(self) -> list[EngineInstall]:
        """The engines installed here (kind, version) for NodeState.engines."""

    @abc.abstractmethod
    def models(self) -> list[ModelState]:
        """Every model this engine knows: name, size_mb, state, last_error."""

    @abc.abstractmethod
    async def load(self, model: str, source: str = "", args: str = "") -> None:
        """Load `model` and return once it serves; raise EngineError with the engine's words.

        `source` is the catalog's Models__N__Source (a file path for llama.cpp, a tag for
        Ollama; empty: the model name), `args` the profile's engine arguments. No timeout
        here: the node wraps the call in `Engine__StartTimeoutSeconds`.
        """

    @abc.abstractmethod
    async def unload(self, model: str) -> None:
        """Unload `model` (a no-op for a model that is not loaded)."""

    @abc.abstractmethod
    def upstream(self, model: str) -> str | None:
        """Base URL (no trailing slash) that serves `model`'s /v1 and /api paths, or None."""

    async def restart(self, model: str) -> None:
        """Stop the process serving `model` and start it again as it was loaded (a replica
        whose generation hangs); only where `restartable`. No timeout: the caller's."""
        raise EngineError(f"the {self.kind} engine's processes are not the node's to restart")

    def dialect(self, model: str) -> str:
        """Which request fields the engine serving `model` takes (engines/params.py)."""
        return "openai"

    def memory_used_mb(self) -> int:
        """MiB the loaded models take, by the engine's own account."""
        return sum(m.size_mb for m in self.models() if m.state in ("ready", "loading"))
