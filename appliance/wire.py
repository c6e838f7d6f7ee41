"""Types that cross the wire between hub and node, shared by both.

Theory of operation: a node describes itself as one `NodeState`; the hub never asks a
node for parts of it. The watch stream (`GET /node/v1/watch`) is NDJSON, one
`WatchEvent` per line: a full `StateEvent` first, another on every change, and a
`Heartbeat` at least every `Node__HeartbeatSeconds`; lines are split on `\\n` only and
hold at most MAX_WATCH_LINE bytes. Peers may be newer than us, so the
decoders are lenient (unknown fields ignored); what we send is what these Structs say.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from appliance import __version__
from appliance.http.lines import LineEncoder

ModelStatus = Literal["available", "loading", "ready", "failed"]
# A loaded model's generation health, as the node's probes last found it (node/probe.py).
# A plain str on the wire (a newer peer may say more); the hub routes only to "ok".
HEALTHY = "ok"
UNHEALTHY = "replica_unhealthy"


class EngineInstall(msgspec.Struct):
    kind: str
    version: str = ""


class ModelMeta(msgspec.Struct, omit_defaults=True):
    """What an engine says about a model (Ollama's /api/tags and /api/ps), passed on to
    the hub's /api/tags, /api/ps and /api/show; empty where the engine says nothing."""

    digest: str = ""
    modified_at: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""
    context_length: int = 0
    # What the engine says the model can do (Ollama's words: completion, tools, vision,
    # embedding, thinking); None: it says nothing.
    capabilities: list[str] | None = None


class ModelState(msgspec.Struct):
    name: str
    size_mb: int = 0
    state: ModelStatus = "available"
    last_error: str = ""
    in_flight: int = 0
    meta: ModelMeta | None = None
    # "replica_unhealthy": a generation probe failed, or a request got no first byte within
    # Node__ProbeTimeoutSeconds; `health_error` says which. The hub routes nothing here then.
    health: str = HEALTHY
    health_error: str = ""
    probe_failures: int = 0  # probes of this model that failed since the node started
    # The engine's own word (llama-server's /props total_slots and /slots): its parallel
    # slots for this model and how many are busy now -- the hub's own requests and any
    # that reach the engine another way. None: the engine does not say.
    slots: int | None = None
    busy: int | None = None
    # The node's mean time from taking a request of this model to its last byte, lately
    # (ms; said only while several hubs watch): a hub that has not had an answer of its own
    # from this node yet takes its service time from here (decide/shared.py).
    service_ms: int | None = None


class Routed(msgspec.Struct, array_like=True):
    """A request a node took with a hub's routing key on it (ROUTE_HEADER), published while
    more than one hub watches it (HA): the other hubs learn where each session and prompt
    went, so they keep it there too. `seq` counts up per node start; `key` is the header's
    value as the hub wrote it (the node never reads it)."""

    seq: int
    model: str
    key: str


class NodeState(msgspec.Struct, dict=True):
    name: str
    version: str = __version__
    engines: list[EngineInstall] = []
    # The node's Engine__Kind, said even while its engine does not answer (then `engines` is
    # empty): the hub places a model only on nodes whose kind can serve it. "": an older node.
    engine: str = ""
    memory_total_mb: int | None = None
    memory_used_mb: int | None = None
    max_concurrency: int | None = None
    # Per-model parallel slots (Ollama's OLLAMA_NUM_PARALLEL); None: not declared.
    slots: int | None = None
    in_flight: int = 0
    paused: bool = False
    left: bool = False
    over_limits: bool = False
    over_limits_reason: str = ""
    models: list[ModelState] = []
    # Hubs that gave this node orders (load, unload) without an HA epoch in the last
    # ORDERS_SECONDS: two or more fight over it (two hubs without Cluster__Etcd).
    hubs: list[str] = []
    # The keyed requests taken in the last few seconds, oldest first (HA only; see Routed).
    routed: list[Routed] = []

    def model(self, name: str) -> ModelState | None:
        """The model called `name` (the first, as listed), by an index built at the first
        look: the control loop asks once per model per pass, and a scan made that pass
        quadratic (2,000 models: 0.4 s a pass). A NodeState is read, not changed, once
        decoded; a `models` list grown, shrunk or replaced is seen and indexed afresh."""
        key = (id(self.models), len(self.models))
        cached = self.__dict__.get("_index")
        if cached is None or cached[0] != key:
            index: dict[str, ModelState] = {}
            for m in self.models:
                index.setdefault(m.name, m)
            cached = self.__dict__["_index"] = (key, index)
        found: ModelState | None = cached[1].get(name)
        return found

    def model_slots(self, name: str) -> int | None:
        """The places of one model: its own count (the engine's, or the hub's per-model
        override written in), else the node's `Node__ModelSlots`."""
        m = self.model(name)
        return m.slots if m is not None and m.slots is not None else self.slots


class StateEvent(msgspec.Struct, tag="state"):
    state: NodeState


class Heartbeat(msgspec.Struct, tag="heartbeat"):
    ts: float = 0.0


WatchEvent = StateEvent | Heartbeat


class Announce(msgspec.Struct):
    """`POST /api/nodes/announce` body; the node token is the bearer."""

    name: str
    url: str


# Lines escaped (appliance/http/lines.py): a U+2028 in a model name is not a line break.
watch_encoder = LineEncoder()
watch_decoder = msgspec.json.Decoder(WatchEvent)
announce_decoder = msgspec.json.Decoder(Announce)
# The longest watch line the hub reads: a NodeState of ~10,000 models with their metadata
# (~600 bytes each) and room to spare; a node sending more is broken, not big.
MAX_WATCH_LINE = 16 * 1024 * 1024


def encode_event(ev: StateEvent | Heartbeat) -> bytes:
    return watch_encoder.line(ev)


class LoadRequest(msgspec.Struct):
    """`POST /node/v1/models/{model}/load` body (may be empty): the catalog's source and
    the profile's engine arguments."""

    source: str = ""
    args: str = ""


load_request_decoder = msgspec.json.Decoder(LoadRequest)


# The name of the hub giving a node an order (Hub__Name), on every load and unload.
HUB_HEADER = "x-appliance-hub"

# The routing key of a request the hub sends a node (decide/shared.py writes and reads it);
# a node watched by several hubs publishes it in `NodeState.routed`.
ROUTE_HEADER = "x-appliance-route"

# On a request whose answer the hub only assembles (a generation its client wants whole,
# asked of the engine as a stream), the hub's read bound in seconds: the node sends the
# engine's stream in one body, or in pieces well within that bound (node/whole.py), instead
# of event by event.
WHOLE_HEADER = "x-appliance-whole"

# Fencing (HA): the leading hub's epoch rides on every load and unload it sends; a node
# refuses a call from an older epoch than the highest it has seen (409 `stale_leader`).
EPOCH_HEADER = "x-appliance-epoch"
# The node's own Node__HeartbeatSeconds, on its watch stream's head: the hub declares it
# lost after MISSED_HEARTBEATS of *its* interval, whatever the hub's own setting says.
HEARTBEAT_HEADER = "x-appliance-heartbeat"
# What the hub takes of it: a node cannot make itself unlosable (nor lost at once).
HEARTBEAT_BOUNDS = (0.05, 300.0)


def heartbeat_of(raw: str | None, default: float) -> float:
    """The interval a node's watch stream says (HEARTBEAT_HEADER), bounded; `default`
    (the hub's Node__HeartbeatSeconds) when absent or malformed."""
    if raw is None or len(raw) > 16:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    if value != value:  # NaN
        return default
    low, high = HEARTBEAT_BOUNDS
    return min(max(value, low), high)
# The leader's lease length in seconds, beside its epoch (appliance/node/fence.py).
LEASE_HEADER = "x-appliance-lease"
