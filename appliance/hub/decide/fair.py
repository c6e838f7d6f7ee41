"""A fair share inside one priority class: the next place goes to the key served least.

Owns `FairLane` (the waiters of one class for one model, a FIFO and a virtual token
counter per key: Sheng et al., OSDI'24, VTC), `cost` and `Demand`. Plain synchronous code;
it only orders the waiters the class's own rules (priority.py) let go. The rules:
`FairLane`'s docstring.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Protocol

# The paper's w_q / w_p: an output token costs about twice an input token.
OUTPUT_COST = 2


def cost(tokens_in: int, tokens_out: int) -> int:
    return tokens_in + OUTPUT_COST * tokens_out


class Demand(Protocol):
    """What fair queueing needs of one request: its charge at grant, its key's weight, and
    -- once it ended, as the engine said -- what it really cost (`used`; None: not known,
    the charge stands). The request's lease (limits.Lease) carries it: made at admission,
    `used` filled in when it settles, read by admission when the place is given back."""

    cost: int
    weight: float
    used: int | None


class FairLane:
    """The waiters of one class for one model. Waiters are objects with `client`, `cost`
    (charge at grant) and `weight`; `fair` is set to the (lane, episode) they were charged in.

    The backlogged keys sit in a heap ordered by (counter, last grant, when the key joined
    the backlog); a key's entry is replaced, not updated, when its counter changes (a stale
    entry is skipped when it surfaces), so each step is O(log keys) -- 10,000 waiting keys
    cost what 2 do. A key with one waiter holds it as it is; two or more, in a FIFO (an
    OrderedDict: O(1) removal of one that leaves).

    - The next waiter is the oldest of the backlogged key with the lowest counter; ties go to
      the key granted least recently (a key that just arrived before one that was just
      served), then to the oldest waiter. With one key it is plain FIFO.
    - Granting a waiter charges its key the request's expected cost: input tokens + 2 x
      output tokens (the paper's weights: an output token costs the engine about twice an
      input token), as the key's recent requests went (limits.Limiter.admit; the paper
      counts output as it is generated, which a byte relay does not see). When the request
      ends `settle` charges the difference to what it really used.
    - A key that arrives (or returns) while others are backlogged starts at the lowest counter
      among them -- at least its own -- so time away earns no credit. When the lane empties the
      episode ends and every counter starts again at 0 (charges still settling from the old
      episode are dropped).
    - Work-conserving by construction: this only orders the waiters the class's own rules
      (priority.py) let go; a lone key gets every place.
    Between two keys that stay backlogged the counters differ by at most one request's charge
    (what the property test checks): the VTC bound.
    """

    __slots__ = ("keys", "counters", "last", "n", "episode", "grants", "_heap", "_version",
                 "_joined", "_since")

    def __init__(self) -> None:
        # key -> its one waiter, or an OrderedDict of them (oldest first)
        self.keys: dict[str, Any] = {}
        self.counters: dict[str, float] = {}
        self.last: dict[str, int] = {}  # grant sequence number of each key's last grant
        self.n = 0
        self.episode = 0
        self.grants = 0
        self._heap: list[tuple[float, int, int, str, int]] = []
        self._version: dict[str, int] = {}
        self._joined = 0
        self._since: dict[str, int] = {}  # when each backlogged key joined the backlog

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[Any]:
        for q in self.keys.values():
            if type(q) is OrderedDict:
                yield from q
            else:
                yield q

    def _push(self, k: str) -> None:
        v = self._version.get(k, 0) + 1
        self._version[k] = v
        heap = self._heap
        heapq.heappush(heap, (self.counters.get(k, 0.0), self.last.get(k, -1), self._since[k],
                              k, v))
        if len(heap) > 2 * len(self.keys) + 64:  # stale entries: rebuild
            version = self._version
            self._heap = [e for e in heap if e[3] in self.keys and version.get(e[3]) == e[4]]
            heapq.heapify(self._heap)

    def _top(self) -> tuple[float, int, int, str, int] | None:
        heap, keys, version = self._heap, self.keys, self._version
        while heap:
            e = heap[0]
            if e[3] in keys and version[e[3]] == e[4]:
                return e
            heapq.heappop(heap)
        return None

    def _drop(self, k: str) -> None:
        del self.keys[k]  # its heap entry goes stale
        del self._since[k]

    def add(self, w: Any) -> None:
        if not self.n:  # a new backlog: a new episode, nobody owes anything
            self.episode += 1
            self.counters.clear()
            self.last.clear()
            self._heap.clear()
            self._version.clear()
            self._since.clear()
        k = w.client
        q = self.keys.get(k)
        if q is None:
            top = self._top()
            floor = top[0] if top is not None else 0.0
            own = self.counters.get(k, 0.0)
            self.counters[k] = own if own > floor else floor
            self.keys[k] = w
            self._joined += 1
            self._since[k] = self._joined
            self._push(k)
        elif type(q) is OrderedDict:
            q[w] = None
        else:
            self.keys[k] = OrderedDict(((q, None), (w, None)))
        self.n += 1

    def remove(self, w: Any) -> bool:
        k = w.client
        q = self.keys.get(k)
        if q is None:
            return False
        if type(q) is OrderedDict:
            if q.pop(w, 0) is not None:
                return False
            if not q:
                self._drop(k)
        elif q is w:
            self._drop(k)
        else:
            return False
        self.n -= 1
        return True

    def head(self) -> Any:
        top = self._top()
        if top is None:
            return None
        q = self.keys[top[3]]
        return next(iter(q)) if type(q) is OrderedDict else q

    def by_turn(self) -> list[str]:
        """The backlogged keys in the order `pop` would serve them (O(keys log keys))."""
        return sorted(self.keys, key=lambda k: (self.counters.get(k, 0.0), self.last.get(k, -1),
                                                self._since[k]))

    def pop(self, key: str | None = None) -> Any:
        """The next waiter -- or `key`'s oldest (a key passed over: share.py) -- charged."""
        if key is None:
            top = self._top()
            if top is None:
                raise IndexError("no waiter")
            k = top[3]
        else:
            k = key
        q = self.keys[k]
        if type(q) is OrderedDict:
            w = q.popitem(last=False)[0]
            more = bool(q)
        else:
            w, more = q, False
        self.n -= 1
        self.counters[k] = self.counters.get(k, 0.0) + w.cost / w.weight
        self.grants += 1
        self.last[k] = self.grants
        if more:
            self._push(k)
        else:
            self._drop(k)
        w.fair = (self, self.episode)
        return w

    def settle(self, client: str, episode: int, charged: float, used: float,
               weight: float) -> None:
        """A granted request ended having cost `used` (charged `charged` at grant)."""
        if episode == self.episode and client in self.counters:
            self.counters[client] += (used - charged) / weight
            if client in self.keys:
                self._push(client)

    def backlog(self) -> dict[str, int]:
        """Waiters per key."""
        return {k: len(q) if type(q) is OrderedDict else 1 for k, q in self.keys.items()}
