"""The configuration's schema: every section and key as msgspec structs, their defaults
and bounds (`Config` is the whole), and `ConfigError`.

Theory of operation: every setting is a `Section__Key` (or `Section__N__Key` for lists,
`Section__Key__N__Sub` for a list inside a section, `Profiles__NAME__Args` for named
profiles); the field names here, in PascalCase, are those keys (appliance/config/env.py
reads them from the environment, appliance/config/checks.py holds the rules across fields).
Plain data: no I/O, no parsing of its own.
"""

from __future__ import annotations

import socket
from typing import Annotated, ClassVar, Literal

import msgspec

MiB = 1024 * 1024

NonNeg = Annotated[float, msgspec.Meta(ge=0)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
PriorityClass = Literal["essential", "normal", "background"]
EngineKind = Literal["ollama", "llamacpp", "openai", "sim"]
AffinityMode = Literal["on", "off"]


DEFAULT_NODE_NETWORKS = ("127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                         "fc00::/7")


class ConfigError(Exception):
    """One line naming the variable, the value and what is allowed."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, rename="pascal"):
    pass


class HubConfig(_Section):
    listen: str = "0.0.0.0:8080"
    # The hubs a node announces itself to (comma-separated: one announcer per hub); empty:
    # the node waits to be dialled.
    url: str = ""
    # This hub's name among several (HA: the leader key holds it); empty: the host name.
    name: str = ""
    # 32 MiB: a long chat history with a few images fits; a runaway upload does not.
    max_body_bytes: PosInt = 32 * MiB
    drain_seconds: NonNeg = 30.0
    # Processes serving the client listener: 1 is one process; N>1 adds N-1 relay workers
    # (appliance/hub/workers/pool.py). 1..8.
    workers: int = 1
    # Cap of the jittered reconnect backoff of a node supervisor.
    reconnect_max_seconds: PosFloat = 30.0
    # Longest silence between two chunks from a node before the request is failed.
    upstream_read_seconds: PosFloat = 600.0
    # How often the control loop looks at the fleet (placement, idle unload).
    control_interval_seconds: PosFloat = 1.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # HTTP hygiene on every listener of the hub (appliance/server/limits.py, connection.py). nginx's
    # client_header_timeout/client_body_timeout are 60 s each; a request head is a few
    # hundred bytes, so 10 s is generous for it, and a 32 MiB body at LAN speed takes < 1 s.
    header_read_seconds: PosFloat = 10.0
    body_read_seconds: PosFloat = 60.0
    # A write to a client that makes no progress this long ends the connection (its place
    # is given back, the audit says client_too_slow): a client that stops reading holds
    # nothing longer, and the drain ends whatever clients do.
    write_stall_seconds: PosFloat = 30.0
    # A client that is behind (the answer waits on it) and reads slower than this, over waits
    # summing to WriteStallSeconds, is ended the same way (0: any rate). Kestrel's
    # MinResponseDataRate is 240; 1 KiB/s is still far below any real link.
    min_read_bytes_per_second: NonNegInt = 1024
    # Open client connections per listener; beyond it new ones wait in the kernel's backlog.
    max_connections: PosInt = 4096
    # Bytes of request bodies held at once per listener; beyond it 503 `busy`.
    max_buffered_bytes: PosInt = 256 * MiB
    # Where an announced node may resolve to (static nodes are trusted): loopback and the
    # private ranges of RFC 1918 / RFC 4193. Link-local (cloud metadata) is refused always.
    node_networks: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_NODE_NETWORKS))
    # An announced node unreachable this long is dropped (it re-announces if it comes back).
    forget_node_seconds: PosFloat = 600.0
    max_nodes: PosInt = 256
    # Browser origins allowed to call the API (like OLLAMA_ORIGINS): comma-separated, `*` any.
    cors_origins: str = ""


class MetricsConfig(_Section):
    # None: the role's default (0.0.0.0:9464 hub, 0.0.0.0:9465 node); "": no server.
    listen: str | None = None


class ClientConfig(_Section):
    name: str = ""
    key: str = ""
    priority: PriorityClass = "normal"
    # Globs of the models this client may use; empty: all.
    models: list[str] = []
    # Per-key limits (hub/decide/limits.py); none: no limit, 0: refuse. The upper bounds
    # only catch typos (an extra digit or three): no hub serves more.
    rpm: Annotated[int, msgspec.Meta(ge=0, le=10_000_000)] | None = None
    tpm: Annotated[int, msgspec.Meta(ge=0, le=10_000_000_000)] | None = None
    tokens_per_day: Annotated[int, msgspec.Meta(ge=0, le=10_000_000_000_000)] | None = None
    max_concurrent: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    # The key's share of its class when requests queue (fair queueing, hub/decide/fair.py).
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0
    # Whether the key's Ollama keep_alive 0 / -1 unloads / pins a model for everyone (the
    # admin key's always does); otherwise it holds the model for its idle time at most.
    manage_models: bool = False


class NodeCredential(_Section):
    name: str = ""
    token: str = ""


class AuthConfig(_Section):
    node_token: str = ""
    require_keys: bool = False
    admin_key: str = ""
    clients: list[ClientConfig] = []
    # Per-node tokens: the named node announces (and is dialled) with its own token only.
    nodes: list[NodeCredential] = []
    # Output tokens a token limit reserves for a request that names no cap (max_tokens):
    # about a long chat answer.
    reserve_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1024

    def node_token_for(self, name: str) -> str:
        """The token the node `name` and the hub use between them."""
        for c in self.nodes:
            if c.name == name:
                return c.token
        return self.node_token


class NodeRef(_Section):
    name: str = ""
    url: str = ""


class NodeConfig(_Section):
    name: str = ""
    listen: str = "0.0.0.0:9090"
    advertise_url: str = ""
    max_concurrency: PosInt | None = None
    model_slots: PosInt = 1
    memory_mb: NonNegInt | None = None
    heartbeat_seconds: PosFloat = 2.0
    # How often a node repeats its announcement to Hub__Url.
    announce_seconds: PosFloat = 15.0
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # The node API's twins of Hub__HeaderReadSeconds / Hub__BodyReadSeconds /
    # Hub__WriteStallSeconds.
    header_read_seconds: PosFloat = 10.0
    body_read_seconds: PosFloat = 60.0
    write_stall_seconds: PosFloat = 30.0
    # Off by default: the node's client is the hub, which keeps the rule for its own clients
    # (a node that cut first would end a stream the hub would have audited client_too_slow).
    min_read_bytes_per_second: NonNegInt = 0
    # The node's own twins of the hub's settings (it read Hub__* before; those are still
    # read when these are unset, with a warning: NODE_OWN).
    max_body_bytes: PosInt = 32 * MiB
    upstream_read_seconds: PosFloat = 600.0
    drain_seconds: NonNeg = 30.0
    # Generation probes (node/probe.py): a model idle this long gets a one-token generation
    # (0: no probes); a probe -- or a streamed request's first byte -- that takes longer
    # than the timeout marks the replica unhealthy.
    probe_seconds: NonNeg = 60.0
    probe_timeout_seconds: PosFloat = 30.0


class EngineConfig(_Section):
    kind: EngineKind = "ollama"
    url: str = "http://127.0.0.1:11434"
    command: str = "llama-server -m {model} --port {port} {args}"
    start_timeout_seconds: PosFloat = 120.0
    # How often the ollama/sim/openai adapters re-read the engine's model list (/api/tags,
    # /api/ps, /v1/models): models pulled or unloaded behind the node's back show within 5 s.
    poll_seconds: PosFloat = 5.0


SimCapability = Literal["completion", "tools", "vision", "embedding", "thinking"]
# What a simulated model can do unless told (no vision: images to it are refused, as a text
# model's are).
SIM_CAPABILITIES: tuple[SimCapability, ...] = ("completion", "tools", "thinking", "embedding")


class SimModel(_Section):
    name: str = ""
    size_mb: NonNegInt = 500
    load_seconds: NonNeg = 0.0
    fail_load: str = ""
    # A fault for probes: the model loads and /health answers, but no generation starts.
    hang: bool = False
    # What /api/show says it can do; empty: SIM_CAPABILITIES.
    capabilities: list[SimCapability] = []

    def caps(self) -> list[str]:
        return list(self.capabilities or SIM_CAPABILITIES)


class SimConfig(_Section):
    listen: str = "127.0.0.1:11435"
    models: list[SimModel] = []
    tokens_per_second: NonNeg = 200.0
    parallel: PosInt = 4
    # The prefix cache per node and model (appliance/sim/cache.py), in prompt tokens;
    # 0: none. 32768 is one long context's worth, as a small GPU's KV cache holds.
    cache_tokens: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 32768
    # Prompt tokens per second of prefill (time to first token = uncached tokens / this);
    # 0: prefill is free. 4000 is a 7-8B model's prefill on one consumer GPU.
    prefill_tokens_per_second: NonNeg = 4000.0

    def effective_models(self) -> list[SimModel]:
        return self.models or [SimModel(name="sim-small", size_mb=500)]


class RouterConfig(_Section):
    activation_wait_seconds: NonNeg = 45.0
    # Session and prefix affinity (appliance/hub/decide/affinity.py); off: today's spread.
    affinity: AffinityMode = "on"
    # A node this far above the mean in-flight of the model's nodes is passed over
    # (HAProxy's hash-balance-factor 125 is the same 1.25); 1 is strict balance.
    affinity_load_factor: Annotated[float, msgspec.Meta(ge=1.0, le=100.0)] = 1.25
    # Prefix-index entries per model (one per prompt block of 256 bytes: ~40 B each).
    affinity_index_entries: Annotated[int, msgspec.Meta(ge=1, le=10_000_000)] = 100_000
    # Bytes per prefix block: llama.cpp and vLLM reuse a cache by tokens (vLLM in blocks of
    # 16 tokens), 256 bytes is ~64 tokens: a short system prompt is a few blocks.
    affinity_block_chars: Annotated[int, msgspec.Meta(ge=16, le=1_048_576)] = 256
    # The longest a request waits for the node that holds its cache while that pays
    # (decide/cost.py); 0: never waits. 10 s is a few answers' time on one slot.
    home_wait_seconds: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)] = 10.0


class QueueConfig(_Section):
    max_wait_seconds: NonNeg = 30.0
    max_depth: NonNegInt = 64
    slot_wait_seconds: NonNeg = 0.0


class PriorityConfig(_Section):
    enabled: bool = False
    reserve_slots: NonNegInt = 1
    # Places per model only essential work may take, held against normal and background
    # alike (background is held by reserve_slots + this): hub/decide/priority.py.
    essential_slots: NonNegInt = 0
    background_max_wait_seconds: NonNeg = 600.0
    # An essential request that finds no place may take one from a background request that
    # has no first byte from its engine yet (503 `preempted` to it): hub/decide/admission.py.
    preempt: bool = False


class ModelDef(_Section):
    name: str = ""
    source: str = ""
    profile: str = ""
    memory_mb: NonNegInt | None = None
    # Always-on replica count; 0 means on demand.
    replicas: NonNegInt = 0
    idle_unload_seconds: NonNeg = 300.0
    # Its places per node (parallel slots), over the engine's own count and Node__ModelSlots;
    # None: the engine's word where it says one, else Node__ModelSlots (decide/cost.py).
    slots: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    # On demand (Replicas 0): the most replicas its demand may have placed (decide/demand.py:
    # another while its predicted wait stays over 5 s for 10 s); 1: one, as before.
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    # The engine kind that serves it; "": any engine that can serve the source (a `.gguf`
    # path: llamacpp's). Placement, parking and /api/pull consider only such nodes.
    engine: EngineKind | Literal[""] = ""


class ModelsConfig(_Section):
    INDEXED: ClassVar[str] = "items"
    items: list[ModelDef] = []
    park_after_failures: PosInt = 5
    # Cap of the backoff between two start attempts of one model.
    retry_backoff_max_seconds: PosFloat = 300.0
    # The placement warning repeats at most this often while its reason is unchanged.
    warning_interval_seconds: PosFloat = 600.0


class Profile(_Section):
    args: str = ""


class AuditConfig(_Section):
    path: str = ""
    # Rotated by size: 100 MiB a file, 5 old files kept.
    max_bytes: PosInt = 100 * MiB
    backups: NonNegInt = 5


class StoreConfig(_Section):
    # Where files, batches, stored responses and conversations live (hub/store/): the
    # SQLite file, the uploaded files in `files/` beside it. The systemd unit's
    # StateDirectory; `appliance up`: under $XDG_STATE_HOME/appliance/; empty: no store.
    path: str = "/var/lib/appliance/store.db"
    # OpenAI's own bound on one upload is 512 MB; the total bounds the disk the hub takes.
    max_file_mb: PosInt = 512
    max_total_mb: PosInt = 10240
    # Stored responses are kept 30 days, as OpenAI keeps them.
    response_days: PosInt = 30
    # Objects one key may hold (files, batches, responses, conversations): a runaway
    # client fills its own share, not the disk.
    max_objects_per_key: Annotated[int, msgspec.Meta(ge=1, le=100_000_000)] = 100_000


class BatchConfig(_Section):
    # Batch lines in flight at once per hub (each is background work on the fleet).
    max_concurrent: PosInt = 4
    # The percent of it in flight while essential or normal work arrived within a second
    # (at least one line): at a quarter an essential client's p95 first token stayed at
    # 1.07x its figure alone (bench/batch.py, 2-core box); 100: lines never step aside.
    beside_percent: Annotated[int, msgspec.Meta(ge=0, le=100)] = 25
    # Lines one batch may hold (OpenAI's bound); a batch's lines are checked whole in memory.
    max_lines: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 50_000


class ClusterConfig(_Section):
    # etcd endpoints (comma-separated http(s)://HOST:PORT); empty: one hub, no etcd.
    etcd: str = ""
    prefix: str = "appliance"
    # The leader's lease: a dead leader is replaced this long after its last keepalive.
    lease_seconds: Annotated[int, msgspec.Meta(ge=2, le=3600)] = 10
    # This hub's URL as the other hubs reach it (they ask it for the objects it holds);
    # empty: http(s)://HOST:PORT of Hub__Listen as bound (its host, else this host's name).
    url: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    user: str = ""
    password: str = ""

    def endpoints(self) -> list[str]:
        return [e.strip().rstrip("/") for e in self.etcd.split(",") if e.strip()]


class Config(msgspec.Struct, forbid_unknown_fields=True, rename="pascal"):
    hub: HubConfig = msgspec.field(default_factory=HubConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    auth: AuthConfig = msgspec.field(default_factory=AuthConfig)
    nodes: list[NodeRef] = []
    node: NodeConfig = msgspec.field(default_factory=NodeConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    sim: SimConfig = msgspec.field(default_factory=SimConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    queue: QueueConfig = msgspec.field(default_factory=QueueConfig)
    priority: PriorityConfig = msgspec.field(default_factory=PriorityConfig)
    models: ModelsConfig = msgspec.field(default_factory=ModelsConfig)
    profiles: dict[str, Profile] = {}
    audit: AuditConfig = msgspec.field(default_factory=AuditConfig)
    cluster: ClusterConfig = msgspec.field(default_factory=ClusterConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)

    def node_name(self) -> str:
        return self.node.name or socket.gethostname()

    def hub_name(self) -> str:
        return self.hub.name or socket.gethostname()

    def hub_urls(self) -> list[str]:
        """Hub__Url on a node: the hubs it announces to."""
        return [u.strip() for u in self.hub.url.split(",") if u.strip()]
