"""The environment (and an env file) -> a typed `Config`: the env tree and its loader.

Theory of operation: `Section__Key` names are matched case-insensitively against the
schema (appliance/config/schema.py), optionally behind an `APPLIANCE_` prefix -- the names
InferHub uses, so its env files keep working -- and placed in a tree that msgspec converts
into `Config`; an env file given with `--env-file` is read first and the process
environment overrides it. A bad value or an unknown key under a known section raises
`ConfigError` whose message is one line naming the variable, the value and what is
allowed ("did you mean"); variables of unknown sections are ignored (the process
environment is full of PATH and friends). The rules across fields are checks.py's.
No I/O beyond reading the env file.
"""

from __future__ import annotations

import os
import re
import typing
from typing import Annotated, Any

import msgspec

from appliance.config.checks import _check, _check_finite, _did_you_mean, _enum_hint
from appliance.config.schema import Config, ConfigError

ENV_PREFIX = "APPLIANCE_"


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
