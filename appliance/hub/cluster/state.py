"""What the hubs share in etcd, and the leader's tenure: plain synchronous code, no I/O.

Theory of operation: everything lives under `{Cluster__Prefix}/`:

    leader            the leading hub's name, on its lease; the key's create revision
                      is the EPOCH (etcd revisions only grow, so a later leader always
                      has a higher epoch: nodes fence on it)
    hubs/NAME         every running hub, on its own lease (status shows them), with the
                      URL the other hubs reach it at (they ask it for the objects it holds)
    health/MODEL      the leader's memory of a model: consecutive start failures, parked,
                      last error, unplaceable reason, the definition it failed with, and
                      `decided` -- the last ask revision the leader made a decision for
    asks/MODEL        a follower needs MODEL placed (its mod revision is the ask)
    retry/MODEL       `ctl retry` on any hub; the leader applies and deletes it
    cordons/NODE      cordoned on any hub, so on every hub
    nodes/NAME        a node announced to some hub (URL): every hub dials it
    forgotten/NAME    `ctl forget` on some hub: every hub drops the node, unless it has
                      announced again since (a later revision of nodes/NAME)

This module decides how a range of keys reads (`parse`), how a model's health is written
(`record_of`) and taken over (`adopt` -- a follower mirrors it, a new leader continues
from it; a definition that changed since the failures unparks, as a reload would), which
hubs are asked for their objects (`PeerUrls`), and whether this hub still leads
(`Tenure`: until the lease it last renewed would end, counted from when the renewal was
*sent*, so etcd's own expiry is never earlier than ours).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgspec


class HealthRecord(msgspec.Struct, omit_defaults=True):
    failures: int = 0
    parked: bool = False
    last_error: str = ""
    unplaceable: str = ""
    definition: list[str] = []
    decided: int = 0


_enc = msgspec.json.Encoder()
_health_dec = msgspec.json.Decoder(HealthRecord)


class Keys:
    def __init__(self, prefix: str) -> None:
        self.root = prefix.rstrip("/") + "/"
        self.leader = self.root + "leader"

    def hub(self, name: str) -> str:
        return f"{self.root}hubs/{name}"

    def health(self, model: str) -> str:
        return f"{self.root}health/{model}"

    def ask(self, model: str) -> str:
        return f"{self.root}asks/{model}"

    def retry(self, model: str) -> str:
        return f"{self.root}retry/{model}"

    def cordon(self, node: str) -> str:
        return f"{self.root}cordons/{node}"

    def node(self, name: str) -> str:
        return f"{self.root}nodes/{name}"

    def forgotten(self, name: str) -> str:
        return f"{self.root}forgotten/{name}"


@dataclass
class Snapshot:
    """One read of the whole prefix."""

    revision: int = 0
    leader: str = ""
    epoch: int = 0
    hubs: list[str] = field(default_factory=list)
    hub_urls: dict[str, str] = field(default_factory=dict)  # hub name -> its URL
    health: dict[str, HealthRecord] = field(default_factory=dict)
    asks: dict[str, int] = field(default_factory=dict)
    retries: dict[str, int] = field(default_factory=dict)
    cordons: set[str] = field(default_factory=set)
    nodes: dict[str, str] = field(default_factory=dict)
    node_revs: dict[str, int] = field(default_factory=dict)  # when each was last announced
    forgotten: dict[str, int] = field(default_factory=dict)  # node -> revision of the forget
    raw: dict[str, str] = field(default_factory=dict)


def parse(keys: Keys, revision: int, kvs: Any) -> Snapshot:
    """`kvs`: objects with key, value, create_revision, mod_revision (etcd.KV). Unreadable
    records are skipped: another version's writing must not stop this one."""
    s = Snapshot(revision=revision)
    for kv in kvs:
        s.raw[kv.key] = kv.value
        if kv.key == keys.leader:
            s.leader, s.epoch = kv.value, kv.create_revision
            continue
        rest = kv.key[len(keys.root):]
        kind, _, name = rest.partition("/")
        if not name:
            continue
        if kind == "hubs":
            s.hubs.append(name)
            try:
                url = msgspec.json.decode(kv.value).get("url")
            except (msgspec.DecodeError, AttributeError):
                url = None
            if isinstance(url, str) and url.startswith(("http://", "https://")):
                s.hub_urls[name] = url.rstrip("/")
        elif kind == "health":
            try:
                s.health[name] = _health_dec.decode(kv.value)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
        elif kind == "asks":
            s.asks[name] = kv.mod_revision
        elif kind == "retry":
            s.retries[name] = kv.mod_revision
        elif kind == "cordons":
            s.cordons.add(name)
        elif kind == "forgotten":
            s.forgotten[name] = kv.mod_revision
        elif kind == "nodes":
            s.nodes[name], s.node_revs[name] = kv.value, kv.mod_revision
    s.hubs.sort()
    return s


def record_of(h: Any, definition: tuple[str, ...], decided: int) -> HealthRecord:
    """The shared record of one placement.Health."""
    return HealthRecord(failures=h.failures, parked=h.parked, last_error=h.last_error,
                        unplaceable=h.unplaceable,
                        definition=list(definition), decided=decided)


def encode(rec: HealthRecord) -> str:
    return _enc.encode(rec).decode()


def adopt(h: Any, rec: HealthRecord, definition: tuple[str, ...], configured: bool) -> bool:
    """Take `rec` into the placement.Health `h`. Returns True when the record's failures were
    against another definition (a reload changed Source/Profile since): then they do not
    count here and the model is not parked, as a reload on one hub would have done."""
    stale = configured and bool(rec.definition) and tuple(rec.definition) != tuple(definition)
    if stale:
        h.failures, h.parked, h.last_error = 0, False, ""
    else:
        h.failures, h.parked, h.last_error = rec.failures, rec.parked, rec.last_error
    h.unplaceable = rec.unplaceable
    return stale


@dataclass
class PeerUrls:
    """The hubs' URLs as this hub's reads of etcd gave them, each kept `grace` seconds (one
    lease) after a read first lacked it. A hub whose renewal came a lease late (a busy box,
    a slow etcd) loses its key until its next tick writes it again; meanwhile the others
    still ask it for its objects rather than refuse them. One that is really gone does not
    answer there, and is refused as before."""

    grace: float
    urls: dict[str, str] = field(default_factory=dict)
    missing: dict[str, float] = field(default_factory=dict)  # name -> first read without it

    def read(self, current: dict[str, str], now: float) -> None:
        for name in list(self.urls):
            if name not in current and now - self.missing.setdefault(name, now) >= self.grace:
                del self.urls[name], self.missing[name]
        for name, url in current.items():
            self.urls[name] = url
            self.missing.pop(name, None)


@dataclass
class Tenure:
    """This hub's leadership: the epoch it won with, and until when it may act on it."""

    epoch: int = 0
    deadline: float = -math.inf

    def won(self, epoch: int, sent_at: float, lease_seconds: float) -> None:
        self.epoch, self.deadline = epoch, sent_at + lease_seconds

    def renewed(self, sent_at: float, ttl: float) -> None:
        if self.epoch:
            self.deadline = max(self.deadline, sent_at + ttl)

    def leading(self, now: float) -> bool:
        return self.epoch > 0 and now < self.deadline

    def lapsed(self, now: float) -> bool:
        """Held an epoch whose lease ran out without a renewal (to be stepped down)."""
        return self.epoch > 0 and now >= self.deadline

    def end(self) -> int:
        was, self.epoch, self.deadline = self.epoch, 0, -math.inf
        return was
