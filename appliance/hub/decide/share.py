"""Fair share to the first token: a place kept back for the other keys of a class.

Owns `Shares`: per model and class, which keys hold places and were active lately. Fair
queueing (fair.py) puts the key served least first in line, but where one key's long
streams hold every place, first in line still waits. So while more than one key of a
class was active in the last `ACTIVE_SECONDS`, no key holds more places than the others
leave it:

    cap(K) = max(share(K), places - sum over the other active keys j of
                                    min(share(j), max(1, held(j) + waiting(j))))
    share(k) = max(1, floor(places x weight(k) / the active keys' weights))

A lone key takes every place again; a fleet that declares no bound keeps nothing back.
Plain synchronous code, time as an argument: admission's core asks `take` before a request
takes a place (True: it may, counted held) and the shell `release`s it. It must not wait
or pick a node. Only asked where there are keys to share between (Auth__Clients).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# "Lately": a key is active for this long after its last request arrived. An interactive
# user sends every few seconds (a chat turn, an agent's tool call); 10 s keeps its place
# kept back across those gaps without holding it long after it stopped.
ACTIVE_SECONDS = 10.0


@dataclass(slots=True)
class Key:
    seen: float = float("-inf")
    weight: float = 1.0
    held: int = 0


@dataclass(slots=True)
class Group:
    """One model and class: its keys."""

    keys: dict[str, Key] = field(default_factory=dict)


class Shares:
    def __init__(self, active_seconds: float = ACTIVE_SECONDS) -> None:
        self.active_seconds = active_seconds
        self.groups: dict[tuple[str, str], Group] = {}
        self.kept = 0  # requests that waited because their key was at its cap

    def _group(self, model: str, cls: str) -> Group:
        g = self.groups.get((model, cls))
        if g is None:
            g = self.groups[(model, cls)] = Group()
        return g

    def arrive(self, model: str, cls: str, client: str, weight: float, now: float) -> None:
        k = self._group(model, cls).keys.setdefault(client, Key())
        k.seen, k.weight = now, weight

    def cap(self, model: str, cls: str, client: str, places: int | None, now: float,
            waiting: dict[str, int]) -> int | None:
        """The most places `client` may hold now (None: no cap)."""
        g = self.groups.get((model, cls))
        if places is None or g is None:
            return None
        mine = g.keys.get(client)
        active = {n: k for n, k in g.keys.items()
                  if n == client or k.held > 0 or now - k.seen < self.active_seconds}
        if len(active) < 2 or mine is None:
            return None
        total_w = sum(k.weight for k in active.values()) or 1.0

        def share(k: Key) -> int:
            return max(1, int(places * k.weight / total_w))

        kept = sum(min(share(k), max(1, k.held + waiting.get(n, 0)))
                   for n, k in active.items() if n != client)
        return max(share(mine), places - kept)

    def quiet_at(self, model: str, cls: str, now: float) -> float | None:
        """When the next key of the group that holds nothing goes quiet (what it keeps back
        is free for the others then; the shell looks again at that time), None: none will."""
        g = self.groups.get((model, cls))
        if g is None or len(g.keys) < 2:
            return None
        ends = [k.seen + self.active_seconds for k in g.keys.values()
                if k.held == 0 and k.seen + self.active_seconds > now]
        return min(ends, default=None)

    def take(self, model: str, cls: str, client: str, places: int | None, now: float,
             waiting: dict[str, int]) -> bool:
        """May `client` take one more place now? If so it is counted held."""
        k = self._group(model, cls).keys.setdefault(client, Key(seen=now))
        cap = self.cap(model, cls, client, places, now, waiting)
        if cap is not None and k.held >= cap:
            self.kept += 1
            return False
        k.held += 1
        return True

    def release(self, model: str, cls: str, client: str, now: float) -> None:
        g = self.groups.get((model, cls))
        k = g.keys.get(client) if g is not None else None
        if k is None:
            return
        k.held = max(0, k.held - 1)
        self._forget(model, cls, now)

    def _forget(self, model: str, cls: str, now: float) -> None:
        """Keys neither holding nor seen lately are dropped: the state stays bounded by the
        keys active in the last ACTIVE_SECONDS."""
        g = self.groups[(model, cls)]
        if len(g.keys) > 64:
            for n in [n for n, k in g.keys.items()
                      if k.held == 0 and now - k.seen >= self.active_seconds]:
                del g.keys[n]
