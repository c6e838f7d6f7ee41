"""HA fencing on the node: which leader epoch a load or unload may carry.

Theory of operation: with several hubs (Cluster__Etcd) the leading hub sends its epoch
(`x-appliance-epoch`) and its lease length (`x-appliance-lease`) with every load and unload,
and re-asserts both to every node each tick (`POST /node/v1/epoch`). The node keeps the
highest epoch it has heard and refuses a lower one -- a deposed leader that wakes from a
pause must not load or unload -- but only while that highest epoch is alive: an epoch no
caller has asserted for a whole lease (the lease the lower caller states, at least
MIN_LEASE_SECONDS) is no live leader's. So a token holder who sends a forged epoch
(999999999999) fences the real leader out for at most one lease, not until the node
restarts; and the node's remembered epoch shows in its state (and the hub's /api/status).

Plain code with `now` passed in: tested under a virtual clock without sockets.
"""

from __future__ import annotations

import math

# A lease stated below this is taken as this: a caller cannot make a live epoch look dead
# by claiming a tiny lease. Above the cap, the cap: a forged lease of a year does not
# stretch a forged epoch's life.
MIN_LEASE_SECONDS = 1.0
MAX_LEASE_SECONDS = 300.0
# Epochs are etcd revisions: positive 63-bit integers.
MAX_EPOCH = 2**63 - 1


class Fence:
    def __init__(self) -> None:
        self.epoch = 0  # the highest live epoch heard; 0: none
        self.heard = -math.inf  # when a caller last asserted it
        self.forgotten = 0  # epochs given up as dead (status, logs)

    def check(self, epoch: int, lease: float, now: float) -> str:
        """"" to go ahead (and remember `epoch`), else why the caller is refused."""
        if not 0 < epoch <= MAX_EPOCH:
            return f"epoch {epoch} is out of range"
        lease = min(max(lease, MIN_LEASE_SECONDS), MAX_LEASE_SECONDS)
        if epoch >= self.epoch:
            self.epoch, self.heard = epoch, now
            return ""
        if now - self.heard > lease:
            # No caller has asserted the higher epoch for a whole lease: no live leader holds
            # it (a forged one, or a leader long gone). Take the caller's.
            self.forgotten += 1
            self.epoch, self.heard = epoch, now
            return ""
        return f"epoch {epoch} is older than {self.epoch}: another hub leads now"


def parse_lease(raw: bytes | None, default: float) -> float:
    """The `x-appliance-lease` header as seconds; the default when absent or malformed."""
    if raw is None or len(raw) > 16:
        return default
    try:
        value = float(raw)
    except ValueError:
        return default
    return value if math.isfinite(value) else default


# How long a hub's order counts as "giving this node orders": two hubs without etcd that
# both know a node reconcile it about ten times a second; a minute catches even a slow fight.
ORDERS_SECONDS = 60.0
# At most this many hub names are kept (a token holder naming a new hub per call).
MAX_HUBS = 8


class Orders:
    """Which hubs gave this node orders without an HA epoch lately. Two or more: two hubs
    without Cluster__Etcd both know this node and undo each other's loads -- said by the
    node (its log, `NodeState.hubs`), since neither hub can see the other."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}  # hub name -> when it last gave an order
        self.said: list[str] = []  # the hubs as last reported

    def seen(self, hub: str, now: float) -> list[str] | None:
        """Record an order from `hub`; the hubs giving orders now when that differs from
        what was last said (None: the same)."""
        self.last[hub[:64]] = now
        if len(self.last) > MAX_HUBS:
            del self.last[min(self.last, key=self.last.__getitem__)]
        now_hubs = self.hubs(now)
        if now_hubs == self.said:
            return None
        self.said = now_hubs
        return now_hubs

    def hubs(self, now: float) -> list[str]:
        self.last = {h: t for h, t in self.last.items() if now - t < ORDERS_SECONDS}
        return sorted(self.last)
