"""The configuration's rules msgspec cannot express: finite numbers, unique names and keys,
valid node names, CIDRs, URLs and `HOST:PORT` listens -- each refusal one `ConfigError`
line naming the variable. Plain functions over a loaded `Config`; no I/O.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
import typing

import msgspec

from appliance.config.schema import AffinityMode, Config, ConfigError, EngineKind, PriorityClass


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1)
    if not close:
        return ""
    by_lower = {c.lower(): c for c in choices}
    return f' (did you mean "{by_lower[close[0]]}"?)'


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


def _keys(cfg: Config) -> list[tuple[str, str]]:
    """Every secret a request presents: (its variable, its value), the empty ones left out."""
    out = [(f"Auth__Clients__{i}__Key", c.key) for i, c in enumerate(cfg.auth.clients)]
    out += [(f"Auth__Nodes__{i}__Token", c.token) for i, c in enumerate(cfg.auth.nodes)]
    out += [("Auth__AdminKey", cfg.auth.admin_key), ("Auth__NodeToken", cfg.auth.node_token)]
    return [(var, key) for var, key in out if key]


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
    for var, key in _keys(cfg):
        if key != key.strip() or any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7f
                                     for ch in key):
            raise ConfigError(f"{var} holds white space or a control character: a request's "
                              "header cannot carry it as written (its white space is "
                              "stripped); use a key without them")
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
    for var, urls in (("Cluster__Etcd", cfg.cluster.endpoints()), ("Hub__Url", cfg.hub_urls()),
                      ("Cluster__Url", [cfg.cluster.url] if cfg.cluster.url else [])):
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
