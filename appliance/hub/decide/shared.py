"""Routing memory shared by several hubs through their nodes (HA), plain synchronous code.

Each hub learns where a session's or a prompt's last request went only from its own
answers (cost.py's `Homes`, affinity.py's `PrefixIndex`): with two hubs taking a
conversation's turns in turn, each would send half of them elsewhere once a node is full.
So every request with a routing key carries it to its node (`x-appliance-route`,
`affinity.note`); a node that several hubs watch says the keys it took in its state
(node/routed.py, `NodeState.routed`), and each hub folds the ones it has not seen into its
own memory (`Fold.state`):

- `s<32 hex>,<tokens>`: a session (its 16-byte digest) and its prompt tokens, predicted: the
  session's home is that node now (`Homes.record`), as if this hub had sent it.
- `p<16 hex>`: the last block digest of a prompt's prefix chain: that node holds the prompt
  through it (`PrefixIndex.record` of that block: `cost.prefix_held` finds it later).

The node's mean time per answer (`ModelState.service_ms`) is this hub's service time there
until it has an answer of its own from that node (`Rates.hint`). A key from another node
is a peer's word: parsed strictly, tokens bounded, anything else skipped; folding this
hub's own keys changes nothing (it sent them there).
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.hub.decide.affinity import PrefixIndex
from appliance.hub.decide.cost import Homes, Rates
from appliance.wire import NodeState

# The most prompt tokens a key is believed to carry (a million-token context and room).
MAX_TOKENS = 4_000_000


def parse(key: str) -> tuple[str, bytes | int, int] | None:
    """('s', session digest, tokens) or ('p', block digest, 0); None if malformed."""
    kind, body = key[:1], key[1:]
    try:
        if kind == "s":
            digest, _, tokens = body.partition(",")
            n = int(tokens)
            if len(digest) != 32 or not 0 <= n <= MAX_TOKENS:
                return None
            return "s", bytes.fromhex(digest), n
        if kind == "p" and len(body) == 16:
            return "p", int(body, 16), 0
    except ValueError:
        return None
    return None


class Fold:
    """The keys each node said, folded once each (by `seq`, the node's count)."""

    def __init__(self, homes: Callable[[str], Homes],
                 index: Callable[[str], PrefixIndex], rates: Rates | None = None) -> None:
        self.homes, self.index, self.rates = homes, index, rates
        self.seen: dict[str, int] = {}  # node -> the highest seq folded

    def state(self, node: str, st: NodeState) -> int:
        """Fold what `st` says that is new; returns how many keys were folded."""
        if self.rates is not None:
            for m in st.models:
                if m.service_ms is not None:
                    self.rates.hint(node, m.name, m.service_ms / 1000)
        routed = st.routed
        if not routed:
            return 0
        seen = self.seen.get(node, 0)
        if routed[-1].seq < seen:  # the node started afresh: its count did too
            seen = 0
        n = 0
        for r in routed:
            if r.seq <= seen:
                continue
            seen = r.seq
            k = parse(r.key)
            if k is None or st.model(r.model) is None:  # only the node's own models
                continue
            kind, digest, tokens = k
            if isinstance(digest, bytes):
                self.homes(r.model).record(digest, node, tokens)
            else:
                self.index(r.model).record([digest], node)
            n += 1
        self.seen[node] = seen
        return n

    def forget_node(self, node: str) -> None:
        self.seen.pop(node, None)
