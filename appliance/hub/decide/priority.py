"""The admission decision: may this request go now, or must it wait -- and who goes next.

Owns the capacity queue and the reserve as plain synchronous code (DESIGN 5): no sockets,
no trio, no clock. The trio shell (admission.py) hands it a `Fleet` snapshot of one model
(`fleet_of`, `count`), asks it to decide, and waits on what it is told to wait on. It must
not wait nor pick a node. The rules: `AdmissionCore`'s docstring; slot waits: slots.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

from appliance.http.errors import ApiError
from appliance.hub.decide.fit import Node
from appliance.hub.decide.lanes import CLASSES, RANK, Lanes, Waiter

ESSENTIAL, NORMAL, BACKGROUND = CLASSES
# The request headers a client lowers its own class with (ASGI names are lower case).
PRIORITY_HEADERS = (b"x-priority", b"x-inferhub-priority")
# Retry-After on queue_full / queue_timeout: about one short answer's time, so a retry
# lands after some running request has finished (InferHub answers the same 5 s).
QUEUE_RETRY_AFTER = 5.0


def effective_class(enabled: bool, client_cls: str | None, headers: Iterable[tuple[bytes,
                                                                                   bytes]]) -> str:
    """The request's class: the client's, lowered (never raised) by X-Priority headers."""
    if not enabled:
        return NORMAL
    cls = client_cls if client_cls in RANK else NORMAL
    for name, value in headers:
        if name.lower() in PRIORITY_HEADERS:
            asked = value.decode("latin-1").strip().lower()
            if RANK.get(asked, -1) > RANK[cls]:
                cls = asked
    return cls


class Fleet(NamedTuple):
    places: int | None
    room: int | None


N = TypeVar("N", bound=Node)


def fleet_of(nodes: Iterable[Node], model: str) -> Fleet:
    """`places` and `room` for `model` over the nodes it can be routed to now.

    The reference definition, in terms of `NodeHandle.places_left`; `count` is the fast
    one the hub uses (the two are tested equal).
    """
    places: int | None = 0
    room: int | None = 0
    for h in nodes:
        if not h.ready(model) or h.state is None:
            continue
        if places is not None:
            left = h.places_left(model)
            places = None if left is None else places + max(0, left)
        if room is not None:
            cap = h.state.max_concurrency
            room = None if cap is None else room + max(0, cap - h.in_flight_total)
    return Fleet(places, room)


def ready_nodes(nodes: Iterable[N], model: str) -> list[N]:
    """The nodes `model` can be routed to now (what `count` walks)."""
    return [h for h in nodes if h.ready(model)]


def reserve_warning(reserve: int, caps: Iterable[int | None], essential: int = 0) -> str:
    """Why `Priority__ReserveSlots` and `Priority__EssentialSlots` leave background work
    (or, essential places alone, normal work too) no place at all ("" when they do not):
    what they hold back is at least the places of every connected node together. A node
    without a concurrency cap has unbounded places: no warning."""
    total = 0
    for cap in caps:
        if cap is None:
            return ""
        total += cap
    held = reserve + essential
    if held <= 0 or total == 0 or held < total:
        return ""
    if essential >= total:
        return (f"Priority__EssentialSlots={essential} is at least the fleet's {total} places: "
                f"normal and background requests can never run; lower it below {total}")
    if essential:
        return (f"Priority__ReserveSlots={reserve} + Priority__EssentialSlots={essential} = "
                f"{held} is at least the fleet's {total} places: background requests can "
                f"never run; lower them below {total}")
    return (f"Priority__ReserveSlots={reserve} is at least the fleet's {total} places: "
            f"background requests can never run; lower it below {total}")


def count(ready: Iterable[Node], model: str, places_need: int | None = None,
          room_need: int | None = None) -> Fleet:
    """`fleet_of` over nodes already known ready, in plain arithmetic.

    With `places_need`/`room_need` it stops as soon as both are exceeded (or unbounded):
    the numbers are then lower bounds, enough to compare against those needs. This is
    what keeps one request's decision cheap on a large fleet with room to spare.
    """
    places: int | None = 0
    room: int | None = 0
    for h in ready:
        st = h.state
        if st is None:  # not ready after all
            continue
        cap = st.max_concurrency
        slots = st.model_slots(model)
        if cap is None:
            room = None
            if slots is None:
                return Fleet(None, None)
            if places is not None:
                free = slots - h.in_flight.get(model, 0)
                places += free if free > 0 else 0
        else:
            left = cap - h.in_flight_total
            if room is not None:
                room += left if left > 0 else 0
            if places is not None:
                if slots is not None:
                    free = slots - h.in_flight.get(model, 0)
                    left = free if free < left else left
                places += left if left > 0 else 0
        if (places_need is not None and (room is None or room_need is None or room > room_need)
                and (places is None or places > places_need)):
            break
    return Fleet(places, room)


Measure = Callable[[int, int], Fleet]


class ClassStats:
    __slots__ = ("waiting", "held", "released", "timed_out", "requests")

    def __init__(self) -> None:
        self.waiting = self.held = self.released = self.timed_out = self.requests = 0

    def as_dict(self) -> dict[str, int]:
        return {"waiting": self.waiting, "held": self.held, "released": self.released,
                "timed_out": self.timed_out, "requests": self.requests}


class ModelStats:
    __slots__ = ("waiting", "timeouts", "full")

    def __init__(self) -> None:
        self.waiting = self.timeouts = self.full = 0


class AdmissionCore:
    """Two numbers describe a model's fleet, both over the nodes it can be routed to now
    (connected, not paused, not cordoned, not over their limits, model ready):
    - `places`: per node the lesser of what is left of `max_concurrency` and of the model's
      `slots`, summed. None when some node declares neither: it gives nothing to count, so
      nothing is held for it.
    - `room`: what is left of `max_concurrency`, summed; None when some node has no cap. A
      node whose slots are taken but that has concurrency left still takes work (its engine
      queues it; `Queue__SlotWaitSeconds` may delay it): a full fleet is one with no room.

    Rules:
    - essential and normal go while there is room (`room > 0` or unbounded), else wait in the
      capacity queue up to `Queue__MaxWaitSeconds` (503 `queue_timeout` + Retry-After).
    - background (priority on) goes only while `places > Priority__ReserveSlots` (+
      `Priority__EssentialSlots`), else it is held up to `Priority__BackgroundMaxWaitSeconds`
      (503 `priority_wait_timeout`, naming the client). With `Priority__EssentialSlots` > 0
      normal work too goes only while `places > Priority__EssentialSlots`: those places per
      model are essential work's alone. With priority off every request is normal.
    - Waiters for one model are released in class order; within a class the key served
      least goes first (fair.py's virtual token counter), first in first out within a key. A
      request never passes a waiting request of a higher class, nor an older one of its own
      key; the release loop stops at the first head that cannot go, so no lower class
      overtakes a higher one.
    - A waiter is refused at once (503 `queue_full` + Retry-After) when `Queue__MaxDepth`
      requests of its class or higher already wait for the model: lower classes never push a
      higher one out, and the queue's memory stays bounded (3 x MaxDepth per model).
    - A granted waiter has not yet been counted in flight by the router (its task still has
      to wake), so grants are `pending` and subtracted from both numbers until `started`.

    Slot waits are the same idea per node and model: slots.py (`SlotQueues`).
    """
    def __init__(self, *, enabled: bool, reserve: int, max_depth: int, max_wait: float,
                 background_max_wait: float, essential: int = 0) -> None:
        self.configure(enabled=enabled, reserve=reserve, max_depth=max_depth, max_wait=max_wait,
                       background_max_wait=background_max_wait, essential=essential)
        self.queues: dict[str, Lanes] = {}
        self.classes = {c: ClassStats() for c in CLASSES}
        self.models: dict[str, ModelStats] = {}
        # Fair share to the first token (share.py): may this key take a place now (model,
        # class, client)? True counts it held; the shell releases it. None: no such rule.
        self.share: Callable[[str, str, str], bool] | None = None

    def configure(self, *, enabled: bool, reserve: int, max_depth: int, max_wait: float,
                  background_max_wait: float, essential: int = 0) -> None:
        self.enabled = enabled
        self.reserve = reserve
        self.essential = essential  # Priority__EssentialSlots
        self.max_depth = max_depth
        self.max_wait = max_wait
        self.background_max_wait = background_max_wait
        # The classes that need the free places counted to go: background (the reserve),
        # and normal while essential places are kept.
        self.counts_places = frozenset(
            () if not enabled else (BACKGROUND, NORMAL) if essential > 0 else (BACKGROUND,))

    # --- the decision --------------------------------------------------------------------

    def may_go(self, cls: str, fleet: Fleet, pending: int = 0) -> bool:
        """May a request of `cls` take a place now, `pending` places already promised?"""
        room = fleet.room
        if room is not None and room - pending <= 0:
            return False
        if cls in self.counts_places:
            return fleet.places is None or fleet.places - pending > self.held_back(cls)
        return True

    def held_back(self, cls: str) -> int:
        """Free places a request of `cls` must leave: background the reserve and the
        essential places, normal the essential places (Priority__EssentialSlots), essential
        none."""
        if not self.enabled or cls == ESSENTIAL:
            return 0
        return self.essential + (self.reserve if cls == BACKGROUND else 0)

    def held_by_reserve(self, cls: str) -> bool:
        return cls == BACKGROUND and self.enabled

    def arrive(self, model: str, cls: str, client: str, fleet: Fleet | Measure, cost: int = 0,
               weight: float = 1.0) -> Waiter | None:
        """None: go now. A Waiter: wait on it (then `dispatch`). Raises ApiError (queue_full).

        `fleet` is a Fleet, or a function `(places_need, room_need) -> Fleet` (`count`
        over the ready nodes), called only when no one waits ahead of this request.
        `cost` and `weight`: the request's charge and its key's weight (fair.py).
        """
        if not self.enabled:
            cls = NORMAL
        self.classes[cls].requests += 1
        q = self.queues.get(model)
        ahead = q.at_or_above(cls) if q is not None else 0
        if ahead == 0:
            pending = q.pending if q is not None else 0
            if not isinstance(fleet, Fleet):
                fleet = fleet(self.held_back(cls) + pending if cls in self.counts_places else -1,
                              pending)
            if self.may_go(cls, fleet, pending) and (
                    self.share is None or self.share(model, cls, client)):
                return None
        ms = self.models.get(model)
        if ms is None:
            ms = self.models[model] = ModelStats()
        if ahead >= self.max_depth:
            ms.full += 1
            raise ApiError(503, "queue_full",
                             f"the queue for model {model!r} is full ({ahead} waiting, "
                             f"Queue__MaxDepth={self.max_depth})",
                             retry_after=QUEUE_RETRY_AFTER)
        if q is None:
            q = self.queues[model] = Lanes()
        w = Waiter(model, cls, client, cost, weight)
        q.add(w)
        cs = self.classes[cls]
        cs.waiting += 1
        cs.held += 1
        ms.waiting += 1
        return w

    def wait_limit(self, w: Waiter) -> float:
        return self.background_max_wait if self.held_by_reserve(w.cls) else self.max_wait

    def dispatch(self, model: str, fleet: Fleet) -> list[Waiter]:
        """Grant places to waiters of `model` in class order; the ones to wake."""
        q = self.queues.get(model)
        if q is None:
            return []
        woken = []
        while True:
            w = q.head()
            if w is None or not self.may_go(w.cls, fleet, q.pending):
                break
            if self.share is not None and not self.share(model, w.cls, w.client):
                # Its key is at its share (share.py): the next key of its class under its
                # own goes, else the place is kept back.
                w = self._under_share(q, w, model)
                if w is None:
                    break
            else:
                q.pop_head()
            self._dequeued(w)
            w.granted = True
            q.pending += 1
            woken.append(w)
        return woken

    def _under_share(self, q: Lanes, capped: Waiter, model: str) -> Waiter | None:
        """The oldest waiter of the first key of `capped`'s class, in fair order, that may
        take a place (share.py counts it held), taken out of its lane; None: none may."""
        assert self.share is not None
        lane = q.lanes[RANK[capped.cls]]
        for k in lane.by_turn():
            if k != capped.client and self.share(model, capped.cls, k):
                w: Waiter = lane.pop(k)
                return w
        return None

    def started(self, w: Waiter) -> None:
        """A granted waiter's task woke: the router counts it in flight now."""
        self.classes[w.cls].released += 1
        self._unpend(w)

    def leave(self, w: Waiter, *, timed_out: bool) -> bool:
        """The waiter gives up (its wait ran out, or its client hung up).

        True when it gave back a granted place: dispatch the model again.
        """
        if w.granted:
            self._unpend(w)
            return True
        q = self.queues.get(w.model)
        if q is not None and q.remove(w):
            self._dequeued(w)
            if timed_out:
                self.classes[w.cls].timed_out += 1
                self.models[w.model].timeouts += 1
            self._forget(w.model, q)
        return False

    def timeout_error(self, w: Waiter) -> ApiError:
        if self.held_by_reserve(w.cls):
            return ApiError(503, "priority_wait_timeout",
                              f"background work of client {w.client!r} waited "
                              f"{self.background_max_wait:g} s "
                              f"(Priority__BackgroundMaxWaitSeconds) for more than {self.reserve} "
                              "free place(s) "
                              f"for model {w.model!r}; retry later")
        return ApiError(503, "queue_timeout",
                          f"no free place for model {w.model!r} within {self.max_wait:g} s "
                          "(Queue__MaxWaitSeconds)",
                          retry_after=QUEUE_RETRY_AFTER)

    def queued(self) -> dict[str, int]:
        """Waiters per key, over every model and class."""
        out: dict[str, int] = {}
        for q in self.queues.values():
            for lane in q.lanes:
                for k, n in lane.backlog().items():
                    out[k] = out.get(k, 0) + n
        return out

    def waiting_models(self) -> list[str]:
        return [m for m, q in self.queues.items() if len(q)]

    def statistics(self) -> dict[str, Any]:
        return {"classes": {c: s.as_dict() for c, s in self.classes.items()},
                "models": {m: {"waiting": s.waiting, "timeouts": s.timeouts, "full": s.full}
                           for m, s in self.models.items()}}

    # --- bookkeeping ---------------------------------------------------------------------

    def _dequeued(self, w: Waiter) -> None:
        self.classes[w.cls].waiting -= 1
        self.models[w.model].waiting -= 1

    def _unpend(self, w: Waiter) -> None:
        w.granted = False
        q = self.queues.get(w.model)
        if q is not None:
            q.pending -= 1
            self._forget(w.model, q)

    def _forget(self, model: str, q: Lanes) -> None:
        if not q.pending and not len(q):
            del self.queues[model]
