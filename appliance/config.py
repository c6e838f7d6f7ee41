"""Environment variables -> typed configuration.

Theory of operation: every setting is a `Section__Key` (or `Section__N__Key` for lists,
`Section__Key__N__Sub` for a list inside a section, `Profiles__NAME__Args` for named
profiles), matched case-insensitively, optionally behind an `APPLIANCE_` prefix -- the
names InferHub uses, so its env files keep working. An env file given with `--env-file`
is read first and the process environment overrides it.

This module never does I/O beyond reading the env file, never starts anything, and makes
one decision: is this configuration valid? A bad value or an unknown key under a known
section raises `ConfigError` whose message is one line naming the variable, the value
and what is allowed ("did you mean"). Variables of unknown sections are ignored: the
process environment is full of PATH and friends.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import socket
import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec

ENV_PREFIX = "APPLIANCE_"
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


class BatchConfig(_Section):
    # Batch lines in flight at once per hub (each is background work on the fleet).
    max_concurrent: PosInt = 4


class ClusterConfig(_Section):
    # etcd endpoints (comma-separated http(s)://HOST:PORT); empty: one hub, no etcd.
    etcd: str = ""
    prefix: str = "appliance"
    # The leader's lease: a dead leader is replaced this long after its last keepalive.
    lease_seconds: Annotated[int, msgspec.Meta(ge=2, le=3600)] = 10
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


# --- parsing -----------------------------------------------------------------------------

_INDEX = re.compile(r"^\d+$")


def _pascal_fields(cls: type) -> dict[str, tuple[str, typing.Any]]:
    """lower-case pascal name -> (pascal name, type) for a Struct class."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for f in msgspec.structs.fields(cls):
        out[f.encode_name.lower()] = (f.encode_name, hints[f.name])
    return out


def _strip(tp: typing.Any) -> typing.Any:
    """Annotated[X, ...] -> X; X | None -> X."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return tp


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1)
    if not close:
        return ""
    by_lower = {c.lower(): c for c in choices}
    return f' (did you mean "{by_lower[close[0]]}"?)'


def _place(tree: dict[str, Any], cls: type, segs: list[str], value: str, var: str,
           path: list[str]) -> None:
    """Put `value` at `segs` under the Struct `cls` into `tree`, canonicalising names."""
    fields = _pascal_fields(cls)
    head = segs[0]
    indexed: str | None = getattr(cls, "INDEXED", None)
    if _INDEX.match(head) and indexed:
        name, tp = fields[indexed.lower()]
        segs = [name.lower(), *segs]
        head = segs[0]
    if head.lower() not in fields:
        raise ConfigError(
            f"{var}: unknown key {head!r} under {'__'.join(path) or 'root'}"
            f"{_did_you_mean(head, [n for n, _ in fields.values()])}"
        )
    name, tp = fields[head.lower()]
    _place_typed(tree, name, _strip(tp), segs[1:], value, var, [*path, name])


def _place_typed(tree: dict[str, Any], name: str, tp: typing.Any, rest: list[str], value: str,
                 var: str, path: list[str]) -> None:
    origin = typing.get_origin(tp)
    if not rest:
        if origin is list:
            item = _strip(typing.get_args(tp)[0])
            if isinstance(item, type) and issubclass(item, msgspec.Struct):
                raise ConfigError(
                    f"{var}: {'__'.join(path)} is a list; set {'__'.join(path)}__0__<Key>")
            tree[name] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            tree[name] = value
        return
    if origin is list:
        if not _INDEX.match(rest[0]):
            raise ConfigError(f"{var}: expected an index after {'__'.join(path)}, got {rest[0]!r}")
        item = _strip(typing.get_args(tp)[0])
        if len(rest) > 1 and not (isinstance(item, type) and issubclass(item, msgspec.Struct)):
            raise ConfigError(f"{var}: {'__'.join([*path, rest[0]])} is a value, not a section")
        slot = tree.setdefault(name, {}).setdefault(int(rest[0]), {} if len(rest) > 1 else None)
        if len(rest) == 1:
            tree[name][int(rest[0])] = value
        else:
            _place(slot, item, rest[1:], value, var, [*path, rest[0]])
        return
    if origin is dict:
        item = _strip(typing.get_args(tp)[1])
        sub = tree.setdefault(name, {}).setdefault(rest[0], {})
        if len(rest) < 2:
            raise ConfigError(f"{var}: expected {'__'.join(path)}__NAME__<Key>")
        _place(sub, item, rest[1:], value, var, [*path, rest[0]])
        return
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        _place(tree.setdefault(name, {}), tp, rest, value, var, path)
        return
    raise ConfigError(f"{var}: {'__'.join(path)} takes no sub-keys")


def _lists(node: typing.Any) -> typing.Any:
    """Turn {index: ...} maps into lists, ordered by index."""
    if isinstance(node, dict):
        if node and all(isinstance(k, int) for k in node):
            return [_lists(node[k]) for k in sorted(node)]
        return {k: _lists(v) for k, v in node.items()}
    return node


def read_env_file(path: str) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments skipped; optional quotes removed."""
    out: dict[str, str] = {}
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise ConfigError(f"--env-file {path}: {e.strerror}") from None
    # Lines end at "\n" only (as systemd's EnvironmentFile=): a U+2028 inside a value stays.
    for n, line in enumerate(text.split("\n"), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[7:].lstrip()
        if "=" not in line:
            raise ConfigError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        k, v = line.split("=", 1)
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]
        out[k.strip()] = v
    return out


def _path_to_var(path: str) -> str:
    """msgspec's `$.Auth.Clients[0].Priority` -> `Auth__Clients__0__Priority`."""
    p = path.removeprefix("$").lstrip(".")
    p = re.sub(r"\[(\d+)\]", r".\1", p)
    p = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", p)
    return "__".join(s for s in p.split(".") if s)


# Settings the node once read from the Hub__ section: Node__X now; Hub__X is still read by
# the node when Node__X is unset, for one release, with a warning (node_deprecations).
NODE_OWN = (("MaxBodyBytes", "max_body_bytes"), ("UpstreamReadSeconds", "upstream_read_seconds"),
            ("DrainSeconds", "drain_seconds"))


def _set_names(merged: typing.Mapping[str, str]) -> set[str]:
    return {(k[len(ENV_PREFIX):] if k.upper().startswith(ENV_PREFIX) else k).lower()
            for k in merged}


def node_deprecations(environ: typing.Mapping[str, str] | None = None,
                      env_file: str | None = None) -> list[str]:
    """One warning line per Hub__X the node still reads in place of an unset Node__X."""
    environ = os.environ if environ is None else environ
    merged = {**(read_env_file(env_file) if env_file else {}), **environ}
    names = _set_names(merged)
    return [f"Hub__{var} is read by the node because Node__{var} is unset: deprecated, "
            f"set Node__{var} (Hub__{var} stops applying to the node in the next release)"
            for var, _ in NODE_OWN if f"hub__{var.lower()}" in names
            and f"node__{var.lower()}" not in names]


def load(environ: typing.Mapping[str, str] | None = None, env_file: str | None = None) -> Config:
    """Parse the env (and env file) into a Config, or raise ConfigError."""
    environ = os.environ if environ is None else environ
    merged: dict[str, str] = {}
    if env_file:
        merged.update(read_env_file(env_file))
    merged.update(environ)
    sections = _pascal_fields(Config)
    tree: dict[str, Any] = {}
    originals: dict[str, str] = {}
    for raw, value in merged.items():
        var = raw[len(ENV_PREFIX):] if raw.upper().startswith(ENV_PREFIX) else raw
        segs = var.split("__")
        if len(segs) < 2 or segs[0].lower() not in sections or any(s == "" for s in segs):
            continue
        _place(tree, Config, segs, value, raw, [])
        originals["__".join(segs).lower()] = raw
    tree = _lists(tree)
    try:
        cfg = msgspec.convert(tree, Config, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.search(r" - at `([^`]+)`$", msg)
        var = _path_to_var(m.group(1)) if m else ""
        # An indexed section's list (`Models__0__X` is Models.Items[0].X) is named as set.
        var = re.sub(r"__Items(?=__\d)", "", var)
        if var.lower() not in originals:  # an item of a comma-separated list: the list's name
            var = re.sub(r"__\d+$", "", var)
        reason = msg[: m.start()] if m else msg
        shown = originals.get(var.lower(), var)
        value = merged.get(shown, "")
        allowed = ""
        em = re.search(r"Invalid enum value '([^']*)'", reason)
        if em:
            allowed = _enum_hint(var, em.group(1))
        raise ConfigError(f"{shown}={value!r}: {reason}{allowed}") from None
    _check_finite(cfg, [], originals, merged)
    names = _set_names(merged)
    for var, attr in NODE_OWN:  # the deprecated fallback (node_deprecations warns)
        if f"hub__{var.lower()}" in names and f"node__{var.lower()}" not in names:
            setattr(cfg.node, attr, getattr(cfg.hub, attr))
    _check(cfg)
    return cfg


def _check_finite(obj: msgspec.Struct, path: list[str], originals: dict[str, str],
                  merged: dict[str, str]) -> None:
    """`inf` and `nan` parse as floats and pass `ge=0`; a bound that never ends is refused."""
    for f in msgspec.structs.fields(obj):
        v = getattr(obj, f.name)
        here = [*path, f.encode_name]
        if isinstance(v, float) and not math.isfinite(v):
            var = "__".join(here)
            shown = originals.get(var.lower(), var)
            raise ConfigError(f"{shown}={merged.get(shown, str(v))!r}: expected a finite number")
        if isinstance(v, msgspec.Struct):
            _check_finite(v, here, originals, merged)
        elif isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, msgspec.Struct):
                    _check_finite(item, [*here, str(i)], originals, merged)
        elif isinstance(v, dict):
            for k, item in v.items():
                if isinstance(item, msgspec.Struct):
                    _check_finite(item, [*here, k], originals, merged)


def _duplicates(var: str, values: list[str], what: str) -> None:
    """Two list entries with the same `what`: one line naming both variables."""
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        if v and v in seen:
            raise ConfigError(
                f"{var.format(seen[v])} and {var.format(i)} have the same {what}: each must be "
                "unique")
        seen.setdefault(v, i)


def _enum_hint(var: str, got: str) -> str:
    choices = {
        "priority": typing.get_args(PriorityClass),
        "kind": typing.get_args(EngineKind),
        "affinity": typing.get_args(AffinityMode),
        "engine": typing.get_args(EngineKind),
    }.get(var.rsplit("__", 1)[-1].lower(), ())
    if not choices:
        return ""
    return f"; allowed: {', '.join(choices)}{_did_you_mean(got, choices)}"


def _check(cfg: Config) -> None:
    """Cross-field rules msgspec cannot express."""
    for i, c in enumerate(cfg.auth.clients):
        if not c.key:
            raise ConfigError(f"Auth__Clients__{i}__Key is empty: every client needs a key")
        if not c.name:
            c.name = f"client-{i}"
    _duplicates("Auth__Clients__{}__Key", [c.key for c in cfg.auth.clients], "key")
    _duplicates("Auth__Clients__{}__Name", [c.name for c in cfg.auth.clients], "name")
    for i, cred in enumerate(cfg.auth.nodes):
        if not valid_node_name(cred.name):
            raise ConfigError(f"Auth__Nodes__{i}__Name={cred.name[:200]!r}: {NODE_NAME_RULE}")
        if not cred.token:
            raise ConfigError(
                f"Auth__Nodes__{i}__Token is empty: every per-node credential needs a token")
    _duplicates("Auth__Nodes__{}__Name", [c.name for c in cfg.auth.nodes], "name")
    for net in cfg.hub.node_networks:
        try:
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            raise ConfigError(
                f"Hub__NodeNetworks={','.join(cfg.hub.node_networks)!r}: {net!r} is not a CIDR"
                " (e.g. 10.0.0.0/8)") from None
    for i, n in enumerate(cfg.nodes):
        if not n.url.startswith(("http://", "https://")):
            raise ConfigError(f"Nodes__{i}__Url={n.url!r}: expected an http:// or https:// URL")
        if not n.name:
            raise ConfigError(f"Nodes__{i}__Name is empty: every static node needs a name")
        if not valid_node_name(n.name):
            raise ConfigError(f"Nodes__{i}__Name={n.name[:200]!r}: {NODE_NAME_RULE}")
    _duplicates("Nodes__{}__Name", [n.name for n in cfg.nodes], "name")
    for i, m in enumerate(cfg.models.items):
        if not m.name:
            raise ConfigError(f"Models__{i}__Name is empty: every model needs a name")
        if m.profile and m.profile not in cfg.profiles:
            raise ConfigError(
                f"Models__{i}__Profile={m.profile!r}: no such profile"
                f"{_did_you_mean(m.profile, cfg.profiles)}; define Profiles__{m.profile}__Args"
            )
    for i, sm in enumerate(cfg.sim.models):
        if not sm.name:
            raise ConfigError(
                f"Sim__Models__{i}__Name is empty: every simulated model needs a name")
    if not 1 <= cfg.hub.workers <= 8:
        raise ConfigError(f"Hub__Workers={cfg.hub.workers}: must be 1..8")
    for var, listen in (("Hub__Listen", cfg.hub.listen), ("Node__Listen", cfg.node.listen),
                        ("Sim__Listen", cfg.sim.listen)):
        parse_listen(listen, var)
    for var, urls in (("Cluster__Etcd", cfg.cluster.endpoints()), ("Hub__Url", cfg.hub_urls())):
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ConfigError(f"{var}={u!r}: expected comma-separated http:// or https:// URLs")
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", cfg.cluster.prefix):
        raise ConfigError(
            f"Cluster__Prefix={cfg.cluster.prefix!r}: expected 1-64 of A-Z a-z 0-9 . _ -")
    if cfg.metrics.listen:
        parse_listen(cfg.metrics.listen, "Metrics__Listen")


# DNS-label-like (RFC 1123 allows 63 per label), plus `.` and `_` that host names and
# systemd unit names use: a node name goes into logs, metrics labels and URLs.
_NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,63}$")
NODE_NAME_RULE = "a node name is 1 to 63 of A-Z a-z 0-9 . _ -"


def valid_node_name(name: str) -> bool:
    return bool(_NODE_NAME.fullmatch(name))


def parse_listen(listen: str, var: str = "listen") -> tuple[str, int]:
    """`HOST:PORT` -> (host, port); port 0 picks a free one."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise ConfigError(f"{var}={listen!r}: expected HOST:PORT (port 0 picks a free one)")
    return host.strip("[]"), int(port)
