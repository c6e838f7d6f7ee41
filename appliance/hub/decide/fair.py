"""A fair share inside one priority class: the next place goes to the key served least.

Theory of operation (issue 21; Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24: the virtual token counter, VTC). Plain synchronous code. A `FairLane` holds the
waiters of one class for one model, one FIFO per key (the client's name), and a counter
per key: the service it was granted while the lane had a backlog, in tokens, divided by
its weight (`Auth__Clients__N__Weight`: weight 2 is served twice as much).
- The next waiter is the oldest of the backlogged key with the lowest counter; ties go to
  the key granted least recently (a key that just arrived before one that was just
  served), then to the oldest waiter. With one key it is plain FIFO.
- Granting a waiter charges its key the request's expected cost: input tokens + 2 x
  output tokens (the paper's weights: an output token costs the engine about twice an
  input token), the input as estimated and the output as the request's cap. When the
  request ends `settle` charges the difference to what it really used.
- A key that arrives (or returns) while others are backlogged starts at the lowest counter
  among them -- at least its own -- so time away earns no credit. When the lane empties the
  episode ends and every counter starts again at 0 (charges still settling from the old
  episode are dropped).
- Work-conserving by construction: this only orders the waiters the class's own rules
  (priority.py) let go; a lone key gets every place.
Between two keys that stay backlogged the counters differ by at most one request's charge
(what the property test checks): the VTC bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

# The paper's w_q / w_p: an output token costs about twice an input token.
OUTPUT_COST = 2


def cost(tokens_in: int, tokens_out: int) -> int:
    return tokens_in + OUTPUT_COST * tokens_out


class FairLane:
    """The waiters of one class for one model. Waiters are objects with `client`, `cost`
    (charge at grant) and `weight`; `fair` is set to the (lane, episode) they were charged in."""

    __slots__ = ("keys", "counters", "last", "n", "episode", "grants")

    def __init__(self) -> None:
        self.keys: dict[str, OrderedDict[Any, None]] = {}
        self.counters: dict[str, float] = {}
        self.last: dict[str, int] = {}  # grant sequence number of each key's last grant
        self.n = 0
        self.episode = 0
        self.grants = 0

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __iter__(self) -> Iterator[Any]:
        for q in self.keys.values():
            yield from q

    def add(self, w: Any) -> None:
        if not self.n:  # a new backlog: a new episode, nobody owes anything
            self.episode += 1
            self.counters.clear()
        q = self.keys.get(w.client)
        if q is None:
            floor = min((self.counters.get(k, 0.0) for k in self.keys), default=0.0)
            self.counters[w.client] = max(self.counters.get(w.client, 0.0), floor)
            q = self.keys[w.client] = OrderedDict()
        q[w] = None
        self.n += 1

    def remove(self, w: Any) -> bool:
        q = self.keys.get(w.client)
        if q is None or q.pop(w, 0) is not None:
            return False
        self.n -= 1
        if not q:
            del self.keys[w.client]
        return True

    def _next_key(self) -> str | None:
        if len(self.keys) == 1:
            return next(iter(self.keys))
        best: tuple[float, int] | None = None
        key = None
        for k in self.keys:  # insertion order: the oldest key first among equals
            rank = (self.counters.get(k, 0.0), self.last.get(k, -1))
            if best is None or rank < best:
                best, key = rank, k
        return key

    def head(self) -> Any:
        k = self._next_key()
        return None if k is None else next(iter(self.keys[k]))

    def pop(self) -> Any:
        k = self._next_key()
        if k is None:
            raise IndexError("no waiter")
        q = self.keys[k]
        w = q.popitem(last=False)[0]
        self.n -= 1
        if not q:
            del self.keys[k]
        self.counters[k] = self.counters.get(k, 0.0) + w.cost / w.weight
        self.grants += 1
        self.last[k] = self.grants
        w.fair = (self, self.episode)
        return w

    def settle(self, client: str, episode: int, charged: float, used: float,
               weight: float) -> None:
        """A granted request ended having cost `used` (charged `charged` at grant)."""
        if episode == self.episode and client in self.counters:
            self.counters[client] += (used - charged) / weight

    def backlog(self) -> dict[str, int]:
        """Waiters per key."""
        return {k: len(q) for k, q in self.keys.items()}
