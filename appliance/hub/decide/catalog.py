"""The model catalog as the control plane keeps it: each model's definition and health.

Theory of operation: `Spec` is a model's definition -- from `Models__N__*`, or a discovered
model's defaults -- and `Health` what the control plane remembers of it (failures, parked,
the last placement result, wants and keep-alive). Plain data; placement.py decides with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from appliance.config import Config, ModelDef
from appliance.hub.decide.holds import Holds

# IdleUnloadSeconds of a discovered model (ModelDef's default).
DISCOVERED_IDLE = ModelDef().idle_unload_seconds


@dataclass
class Spec:
    """A model's definition: from the catalog, or a discovered model's defaults."""

    name: str
    source: str = ""
    profile: str = ""
    args: str = ""
    memory_mb: int | None = None
    replicas: int = 0
    idle_unload_seconds: float = DISCOVERED_IDLE
    configured: bool = False
    engine: str = ""  # Models__N__Engine ("": any engine that can serve the source)
    max_replicas: int = 1  # Models__N__MaxReplicas: on demand, the most its demand places

    def definition(self) -> tuple[str, str, str, str]:
        return (self.source, self.profile, self.args, self.engine)


@dataclass
class Health:
    """What the control plane remembers about one model."""

    failures: int = 0
    last_error: str = ""
    parked: bool = False
    unplaceable: str = ""
    next_attempt: float = 0.0
    asked: bool = False
    last_used: float | None = None
    # The last managing request's Ollama `keep_alive` in seconds (inf: until unloaded, 0:
    # unload once idle); None: the catalog's IdleUnloadSeconds (holds.py).
    keep: float | None = None
    holds: Holds = field(default_factory=Holds)  # other keys' own holds (holds.py)
    asked_gen: int = 0
    decided_gen: int = 0
    warned_reason: str = ""
    warned_at: float = -math.inf
    # Nodes where a start failed in this round: the next attempt goes to another capable
    # node; only once every capable node failed does the round count toward parking.
    tried: set[str] = field(default_factory=set)


def catalog(cfg: Config) -> dict[str, Spec]:
    out = {}
    for d in cfg.models.items:
        args = cfg.profiles[d.profile].args if d.profile in cfg.profiles else ""
        out[d.name] = Spec(d.name, d.source, d.profile, args, d.memory_mb, d.replicas,
                           d.idle_unload_seconds, configured=True, engine=d.engine,
                           max_replicas=d.max_replicas)
    return out


def follows_demand(specs: dict[str, Spec]) -> frozenset[str]:
    """The models whose replica count follows demand (demand.py): on demand, and allowed
    more than one replica. A discovered model has one at most."""
    return frozenset(n for n, s in specs.items() if not s.replicas and s.max_replicas > 1)
