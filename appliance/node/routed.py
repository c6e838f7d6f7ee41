"""Where the hubs' keyed requests went, said back to every hub that watches (issue 27).

Theory of operation. Several hubs (HA) share the nodes but not their routing memory: each
knows only where its own requests for a session or a prompt went, so the turn that comes
through the other hub may be sent elsewhere, away from the engine's cache. The hub writes
each request's routing key on it (`x-appliance-route`, decide/shared.py); while more than
one hub watches this node, the node keeps the keys it took in the last `ROUTED_SECONDS`
(at most `ROUTED_KEEP`) and publishes them in its state (`NodeState.routed`), with its
in-flight counts -- so every hub sees the others' placements and the node's real load
within `PUSH_SECONDS`, not a heartbeat later. The key is opaque here: checked for size and
characters, never read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from appliance.wire import ROUTE_HEADER, Routed

_HEADER = ROUTE_HEADER.encode()

# How long a key is said: a few pushes, so every hub's stream carries it at least once.
ROUTED_SECONDS = 5.0
# The most keys kept (each push carries them all): ~5 KB a state line at most.
ROUTED_KEEP = 128
# The most bytes of one key (a session digest in hex and a token count, as hubs write it).
MAX_KEY = 48
KEY_CHARS = frozenset(b"0123456789abcdefps,")
# Quiet changes (in-flight counts, routed keys) go out at most this often per stream while
# several hubs watch; with one hub they wait for the heartbeat (it counts its own).
PUSH_SECONDS = 0.05


def valid_key(raw: bytes) -> str | None:
    """The header's value if it looks like a hub's key (bounded, [0-9a-f,ps]), else None."""
    if not 0 < len(raw) <= MAX_KEY or not KEY_CHARS.issuperset(raw):
        return None
    return raw.decode("ascii")


class RoutedLog:
    """The keyed requests taken lately, oldest first, each with the time it was taken."""

    def __init__(self) -> None:
        self.entries: deque[tuple[float, Routed]] = deque(maxlen=ROUTED_KEEP)
        self.seq = 0

    def note(self, model: str, key: str, now: float) -> None:
        self.seq += 1
        self.entries.append((now, Routed(self.seq, model, key)))

    def recent(self, now: float) -> list[Routed]:
        """The keys taken in the last ROUTED_SECONDS (older ones are dropped)."""
        entries = self.entries
        while entries and entries[0][0] < now - ROUTED_SECONDS:
            entries.popleft()
        return [r for _, r in entries]


class Noting(Protocol):
    def note_routed(self, model: str, key: str) -> None: ...


def note_route(keeper: Noting, model: str, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """The request's routing key, if a hub wrote a valid one, noted for the other hubs."""
    for k, v in headers:
        if k == _HEADER:
            key = valid_key(v)
            if key is not None:
                keeper.note_routed(model, key)
            return
