"""The hub's view of its fleet: one handle per node, in one registry.

Theory of operation: a node is known statically (`Nodes__N__*`) or by announcing itself;
either way it gets a `NodeHandle` here and one supervisor task (supervisor.py) that keeps
the handle true from the node's watch stream.

The handle's decisions (status, routable, free places) are plain synchronous code. A
replica the node says is unhealthy (its generation probes, node/health.py) is not ready:
nothing is routed to it, and the turn is told to `health_listeners`. The
hub counts its own in-flight requests per node and model, because the node's count
arrives a heartbeat late and admission must not hand one place out twice. Every change
calls the registry's listeners (admission wakes its waiters, status is recomputed) --
no one polls the registry except the activation waiter, on purpose.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable

import trio

from appliance.config import EngineKind
from appliance.wire import UNHEALTHY, NodeState

log = logging.getLogger(__name__)

# A node is lost after this many heartbeats pass without a line (DESIGN 2).
MISSED_HEARTBEATS = 3
# The engine kinds a node may say it runs; anything else a peer sends reads as unknown.
ENGINE_KINDS = frozenset(typing.get_args(EngineKind))


class Flag:
    """A trio.Event whose setting also calls its subscribers: a cut without a watching task.

    A relayed request stops when its node is declared lost (`NodeHandle.lost`) or the drain
    runs out; a task per request waiting for each would cost a nursery, two spawns and two
    cancellations (~45 us of CPU). `set`, `is_set` and `wait` work as trio.Event's and `set`
    also calls every subscribed function, synchronously, once, in the setter's task;
    `subscribe` on a flag already set calls it at once. The relay subscribes `Cut.trip` for
    one attempt and unsubscribes in its `finally`.
    """

    __slots__ = ("_event", "_subs")

    def __init__(self) -> None:
        self._event = trio.Event()
        self._subs: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        if self._event.is_set():
            return
        self._event.set()
        subs, self._subs = self._subs, set()
        for fn in subs:
            fn()

    async def wait(self) -> None:
        await self._event.wait()

    def subscribe(self, fn: Callable[[], None]) -> None:
        """`fn()` when the flag is set (at once when it already is)."""
        if self._event.is_set():
            fn()
        else:
            self._subs.add(fn)

    def unsubscribe(self, fn: Callable[[], None]) -> None:
        self._subs.discard(fn)

    def subscribers(self) -> int:
        return len(self._subs)


class NodeHandle:
    def __init__(self, name: str, url: str, static: bool, token: str = "") -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.static = static
        # A per-node token (Auth__Nodes__N__Token) presented to this node; "": the shared one.
        self.token = token  # sets auth_raw too
        # When the node was last seen going (or staying) unreachable; None while connected.
        self.lost_since: float | None = None
        self.cancel_scope = trio.CancelScope()
        self.state: NodeState | None = None
        self.connected = False
        self.lost_reason = "not connected yet"
        self.last_line = 0.0
        self.cordoned = False
        self.removed = False
        self.in_flight: dict[str, int] = {}
        self.in_flight_total = 0
        # Set to cut the supervisor's backoff short: the URL changed, or the node announced
        # itself while the hub was backing off from it or had it lost (it is back: dial now).
        self.dial_now = trio.Event()
        # Set when this connection of the node is declared lost; a fresh one per connection.
        # Requests on the node watch it: their streams end at once with `node_lost`.
        self.lost = Flag()
        self.answered = False  # sent a NodeState at least once (the start-up grace waits for it)
        # Other hubs' requests on this node, as the node last counted them (HA only).
        self.others: dict[str, int] = {}
        self.others_total = 0
        # HA fencing: the leader epoch the node keeps (as it last said) and, while it refuses
        # this leader's epoch, the node's words ("" when it takes it).
        self.epoch = 0
        self.fenced = ""
        # The node's own heartbeat interval, as its watch stream said (0: not yet heard).
        self.heartbeat = 0.0
        # Models the hub is unloading (or has unloaded) here whose unload the node's state
        # does not show yet: not ready for routing, so a request right after an unload
        # (keep_alive 0) waits for a fresh load instead of meeting "not loaded" (503).
        self.unloading: set[str] = set()
        # The models the node last said are ready and healthy (apply_state): what tells a
        # heartbeat that changes readiness from one that does not.
        self.ready_said: frozenset[str] = frozenset()

    @property
    def token(self) -> str:
        return self._token

    @token.setter
    def token(self, token: str) -> None:
        self._token = token
        # The same for the proxy's pool (client/upstream.py), whose default it replaces:
        # made once per token, not once per request.
        self.auth_raw: list[tuple[bytes, bytes]] = (
            [(b"authorization", f"Bearer {token}".encode())] if token else [])

    @property
    def auth(self) -> dict[str, str]:
        """Headers that override the node client's shared token for this node."""
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    # --- decisions ---------------------------------------------------------------------

    def status(self) -> str:
        """One of up, lost, paused, cordoned, over_limits, left (DESIGN 9)."""
        st = self.state
        if not self.connected or st is None:
            return "lost"
        if st.left:
            return "left"
        if st.paused:
            return "paused"
        if self.cordoned:
            return "cordoned"
        if st.over_limits:
            return "over_limits"
        return "up"

    def kind(self) -> str:
        """The node's engine kind: its Engine__Kind (an older node: its first install's),
        "" while unknown or not one this hub knows (a peer's word, checked here)."""
        st = self.state
        if st is None:
            return ""
        if st.engine in ENGINE_KINDS:
            return st.engine
        if not st.engine and st.engines and st.engines[0].kind in ENGINE_KINDS:
            return st.engines[0].kind
        return ""

    def routable(self) -> bool:
        return self.status() == "up"

    def ready(self, model: str) -> bool:
        if not self.routable():
            return False
        m = self.state.model(model) if self.state is not None else None
        return (m is not None and m.state == "ready" and m.health != UNHEALTHY
                and model not in self.unloading)

    def unhealthy(self, model: str) -> str:
        """Why the node says its ready replica of `model` does not generate, or ""."""
        m = self.state.model(model) if self.state is not None else None
        if m is None or m.state != "ready" or m.health != UNHEALTHY:
            return ""
        return m.health_error or UNHEALTHY

    def places_left(self, model: str) -> int | None:
        """What is left of max_concurrency and of the model's slots, the lesser; None:
        unbounded. Below zero when more is in flight than the slots (requests sent past a
        full slot wait): how far over, which spreading must see."""
        st = self.state
        left: list[int] = []
        if st is None:
            return None
        if st.max_concurrency is not None:
            left.append(st.max_concurrency - self.in_flight_total)
        slots = st.model_slots(model)
        if slots is not None:
            left.append(slots - self.in_flight.get(model, 0))
        return min(left) if left else None

    def has_concurrency(self) -> bool:
        st = self.state
        return st is None or st.max_concurrency is None or self.in_flight_total < st.max_concurrency

    def memory_free_mb(self) -> int | None:
        st = self.state
        if st is None or st.memory_total_mb is None:
            return None
        return st.memory_total_mb - (st.memory_used_mb or 0)


class Registry:
    """All known nodes, their in-flight counts, and who to tell when anything changes."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeHandle] = {}
        self._listeners: list[tuple[Callable[[], None], Callable[[], None]]] = []
        # Several hubs send to the same nodes (HA): each node's own in-flight counts are
        # folded into ours, so priority's reserve holds across hubs (a heartbeat late).
        self.shared = False
        self._changed = trio.Event()
        self._turn = 0  # rotates ties in pick
        # The ready nodes per model (`ready_nodes`), made once per change of readiness --
        # a node's ready models or status, its connection, a cordon, an unload (`changed`,
        # `unloading`) -- not once per request: every part of a request reads one list.
        self._ready: dict[str, list[NodeHandle]] = {}
        # Models__N__Slots: a model's places per node, written over what its engines say
        # (NodeState.model_slots reads it); empty: the engines' word, else Node__ModelSlots.
        self.slot_overrides: dict[str, int] = {}
        # Called with (node, model, why) when a replica turns unhealthy (why) or healthy
        # again ("") by the node's own word (its generation probes): audit, parking count.
        self.health_listeners: list[Callable[[NodeHandle, str, str], None]] = []
        # Called with every state a node sends while several hubs share it (HA): the keys
        # the other hubs routed there (decide/shared.py).
        self.state_listeners: list[Callable[[NodeHandle, NodeState], None]] = []

    def add_listener(self, fn: Callable[[], None],
                     on_finish: Callable[[], None] | None = None) -> None:
        """`fn()` on every change; when a request finishes, `on_finish()` instead if given
        (the control loop, which cares about a finish only while it waits for room)."""
        self._listeners.append((fn, on_finish or fn))

    def changed(self) -> None:
        self._tell()

    def _tell(self, keep_ready: bool = False) -> None:
        if not keep_ready:
            self._ready.clear()
        for fn, _ in self._listeners:
            fn()
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def upsert(self, name: str, url: str, static: bool, token: str = "") -> tuple[NodeHandle, bool]:
        """The handle for `name`; True when it is new (a supervisor must be started)."""
        h = self.nodes.get(name)
        if h is None:
            h = self.nodes[name] = NodeHandle(name, url, static, token)
            self.changed()
            return h, True
        h.token = token
        if h.url != url.rstrip("/") or not h.connected:
            # A new address, or an announcement from a node we are backing off from or
            # have lost: it is there now, so its supervisor dials at once.
            h.url = url.rstrip("/")
            h.dial_now.set()
        return h, False

    def set_slot_overrides(self, overrides: dict[str, int]) -> None:
        """New `Models__N__Slots` (start, reload): applied to the states known now too."""
        self.slot_overrides = overrides
        for h in self.nodes.values():
            if h.state is not None:
                override_slots(h.state, overrides)

    def ready_nodes(self, model: str) -> list[NodeHandle]:
        """The nodes `model` can be routed to now (`NodeHandle.ready`), in registry order;
        the same list until the fleet changes: callers must not change it."""
        ready = self._ready.get(model)
        if ready is None:
            ready = self._ready[model] = [h for h in self.nodes.values() if h.ready(model)]
        return ready

    def unloading(self, h: NodeHandle, model: str, going: bool = True) -> None:
        """The hub is unloading `model` from `h` (no request goes there from now), or (not
        `going`) it stays: routable as the node says."""
        if going:
            h.unloading.add(model)
        else:
            h.unloading.discard(model)
        self._ready.pop(model, None)

    def pick(self, model: str,
             exclude: set[str] | frozenset[str] = frozenset()) -> NodeHandle | None:
        """Where the next request for `model` goes (DESIGN 3 step 5), among the nodes that
        can take it now: the most places left (a node that declares no bound counts as
        unbounded), then the fewest requests in flight, then the next in turn -- so equal
        nodes share evenly and a retry (with `exclude`) goes to the least loaded other."""
        best: list[NodeHandle] = []
        best_key: tuple[float, int] | None = None
        for h in self.nodes.values():
            if h.name in exclude or not h.ready(model) or not h.has_concurrency():
                continue
            left = h.places_left(model)
            key = (float("inf") if left is None else left, -h.in_flight_total)
            if best_key is None or key > best_key:
                best, best_key = [h], key
            elif key == best_key:
                best.append(h)
        if not best:
            return None
        self._turn += 1
        return best[self._turn % len(best)]

    def start(self, h: NodeHandle, model: str) -> None:
        h.in_flight[model] = h.in_flight.get(model, 0) + 1
        h.in_flight_total += 1

    def finish(self, h: NodeHandle, model: str) -> None:
        """A request on `h` ended: the finish listeners (admission's waiters, the control
        loop while it waits for room) are told; readiness did not change."""
        h.in_flight[model] = max(0, h.in_flight.get(model, 0) - 1)
        h.in_flight_total = max(0, h.in_flight_total - 1)
        for _, fn in self._listeners:
            fn()
        self._changed.set()
        self._changed = trio.Event()

    def apply_state(self, h: NodeHandle, state: NodeState) -> None:
        if self.shared:
            count_other_hubs(h, state)
            for seen in self.state_listeners:
                seen(h, state)
        turned = health_turns(h, state)
        was = (h.status(), h.ready_said, len(h.unloading))
        h.state = state
        override_slots(state, self.slot_overrides)
        for name in list(h.unloading):  # the node shows the unload: its own word again
            m = state.model(name)
            if m is None or m.state != "ready":
                h.unloading.discard(name)
        if not h.connected:
            h.lost = Flag()
        h.connected = True
        h.lost_since = None
        h.answered = True
        h.lost_reason = ""
        h.ready_said = frozenset(m.name for m in state.models
                                 if m.state == "ready" and m.health != UNHEALTHY)
        for model, why in turned:
            for fn in self.health_listeners:
                fn(h, model, why)
        # A heartbeat that changes no readiness (the usual one) keeps the ready lists.
        self._tell(keep_ready=(h.status(), h.ready_said, len(h.unloading)) == was)

    def forget(self, h: NodeHandle) -> None:
        """Drop the node: its supervisor is cancelled, nothing routes to it any more."""
        h.removed = True
        h.connected = False
        if self.nodes.get(h.name) is h:
            del self.nodes[h.name]
        h.cancel_scope.cancel()
        self.changed()

    def mark_lost(self, h: NodeHandle, reason: str) -> None:
        """Lost (or still not reached). Logged when it happens and when the reason changes
        -- a node that never answers is said once, not once per reconnect attempt."""
        was, before = h.connected, h.lost_reason
        h.connected = False
        h.lost_reason = reason
        h.lost.set()  # its running streams end now, its unanswered requests go elsewhere
        if was:
            log.warning("node %s lost: %s", h.name, reason)
        elif reason != before:
            log.warning("node %s at %s unreachable: %s (retrying with backoff)", h.name, h.url,
                        reason)
        self.changed()


def count_other_hubs(h: NodeHandle, state: NodeState) -> None:
    """Fold other hubs' work on this node into `h.in_flight`: what the node counts beyond
    what we sent (ours, the counts less the previous estimate of theirs). The node's count
    is a heartbeat late, so theirs is never over-counted for longer than that, and ours
    (counted at once) is never under-counted."""
    reported = {m.name: m.in_flight for m in state.models}
    theirs_before, h.others = h.others, {}
    for name in set(reported) | set(theirs_before):
        ours = max(0, h.in_flight.get(name, 0) - theirs_before.get(name, 0))
        theirs = max(0, reported.get(name, 0) - ours)
        if theirs:
            h.others[name] = theirs
        if theirs or name in h.in_flight:
            h.in_flight[name] = ours + theirs
    ours_total = max(0, h.in_flight_total - h.others_total)
    h.others_total = max(0, state.in_flight - ours_total)
    h.in_flight_total = ours_total + h.others_total


def health_turns(h: NodeHandle, state: NodeState) -> list[tuple[str, str]]:
    """Replicas whose health turns with `state`: (model, why) turned unhealthy, (model, "")
    healthy again. A node's first state after a (re)connect turns only what is unhealthy."""
    out = []
    for m in state.models:
        was = h.unhealthy(m.name) if h.connected else ""
        now = (m.health_error or UNHEALTHY) if m.state == "ready" and m.health == UNHEALTHY else ""
        if was != now and (now or was):
            if now and was:  # unhealthy still, for another reason: no turn
                continue
            out.append((m.name, now))
    return out


def override_slots(state: NodeState, overrides: dict[str, int]) -> None:
    """`Models__N__Slots` written into a node's state, over what its engine said."""
    if overrides:
        for m in state.models:
            n = overrides.get(m.name)
            if n is not None:
                m.slots = n
