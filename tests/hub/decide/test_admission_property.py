"""Property test of the admission core: any sequence of arrivals, completions, hang-ups,
node changes and passing time, on real NodeHandles in a real Registry.

Checked after every step:
- no background request starts (is granted) while free places, less the places already
  promised, are <= Priority__ReserveSlots (priority on);
- no request starts while a request of a higher class, or an earlier one of its own
  class, waits for the same model (no waiter is overtaken by a lower class, FIFO within);
- no request waits that could go now (a freed place always wakes the next waiter);
- in the end every request either started or timed out (or was refused at once, or its
  client hung up), and the core holds nothing.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.http.errors import ApiError
from appliance.hub.decide.lanes import CLASSES, RANK
from appliance.hub.decide.priority import AdmissionCore, fleet_of
from tests.harness.admission_fleet import handle, registry, set_state

MODELS = ("m1", "m2")
TERMINAL = {"started", "timed_out", "refused", "hung_up", "no_capacity"}


class Req:
    def __init__(self, seq: int, model: str, cls: str, client: str, t: float) -> None:
        self.seq, self.model, self.cls, self.client, self.t = seq, model, cls, client, t
        self.state = "new"
        self.waiter = None
        self.deadline = 0.0


class Sim:
    def __init__(self, *, enabled: bool, reserve: int, max_depth: int, immediate: bool,
                 nodes) -> None:
        self.enabled, self.reserve, self.immediate = enabled, reserve, immediate
        self.core = AdmissionCore(enabled=enabled, reserve=reserve, max_depth=max_depth,
                                  max_wait=30.0,
                                  background_max_wait=60.0)
        self.handles = [handle(f"n{i}", slots=s, max_concurrency=c, models=MODELS) for i,
                        (s, c) in enumerate(nodes)]
        self.r = registry(*self.handles)
        self.r.add_listener(self.on_change)
        self.now = 0.0
        self.reqs: list[Req] = []
        self.by_waiter: dict = {}
        self.running: list[tuple[Req, object]] = []
        self.granted: list[Req] = []
        self.stale = False

    # --- the invariants ------------------------------------------------------------------

    def fleet(self, model):
        return fleet_of(self.r.nodes.values(), model)

    def promised(self, model: str) -> int:
        return sum(1 for q in self.granted if q.model == model)

    def could_go(self, cls: str, model: str, pending: int) -> bool:
        places, room = self.fleet(model)
        if room is not None and room - pending <= 0:
            return False
        if cls == "background" and self.enabled:
            return places is None or places - pending > self.reserve
        return True

    def check_may_start(self, req: Req, pending: int) -> None:
        cls = req.cls if self.enabled else "normal"
        assert self.could_go(cls, req.model,
                             pending), f"{req.cls} {req.client} went without a place"
        for other in self.reqs:
            if other is req or other.model != req.model or other.state != "waiting":
                continue
            ocls = other.cls if self.enabled else "normal"
            assert RANK[ocls] > RANK[cls] or (ocls == cls and other.seq > req.seq), \
                f"{req.client} ({cls}) overtook waiting {other.client} ({ocls})"

    def check_nobody_waits_who_could_go(self) -> None:
        if self.stale:
            return
        for model in MODELS:
            waiting = [q for q in self.reqs if q.model == model and q.state == "waiting"]
            if not waiting:
                continue
            head = min(waiting, key=lambda q: (RANK[q.cls if self.enabled else "normal"], q.seq))
            cls = head.cls if self.enabled else "normal"
            assert not self.could_go(cls, model,
                                     self.promised(model)), f"{head.client} waits but could go"

    # --- the steps -----------------------------------------------------------------------

    def on_change(self) -> None:
        self.stale = False
        for model in self.core.waiting_models():
            self.dispatch(model)

    def dispatch(self, model: str) -> None:
        for w in self.core.dispatch(model, self.fleet(model)):
            req = self.by_waiter[w]
            self.check_may_start(req, self.promised(model))
            req.state = "granted"
            self.granted.append(req)
        if self.immediate:
            self.resume_all()

    def start(self, req: Req) -> None:
        node = self.r.pick(req.model)
        if node is None:
            req.state = "no_capacity"  # the router's 503 no_capacity
            return
        self.r.start(node, req.model)
        req.state = "started"
        self.running.append((req, node))

    def arrive(self, model: str, cls: str) -> None:
        req = Req(len(self.reqs), model, cls, f"c{len(self.reqs)}", self.now)
        self.reqs.append(req)
        try:
            w = self.core.arrive(model, cls, req.client, self.fleet(model))
        except ApiError as e:
            assert e.code == "queue_full"
            req.state = "refused"
            return
        if w is None:
            self.check_may_start(req, self.promised(model))
            self.start(req)
            assert req.state == "started"
            return
        req.state, req.waiter = "waiting", w
        req.deadline = self.now + self.core.wait_limit(w)
        self.by_waiter[w] = req
        self.dispatch(model)

    def resume(self, i: int) -> None:
        if self.granted:
            req = self.granted.pop(i % len(self.granted))
            self.core.started(req.waiter)
            self.start(req)

    def resume_all(self) -> None:
        while self.granted:
            self.resume(0)

    def finish(self, i: int) -> None:
        if self.running:
            req, node = self.running.pop(i % len(self.running))
            self.r.finish(node, req.model)

    def hang_up(self, i: int) -> None:
        live = [q for q in self.reqs if q.state in ("waiting", "granted")]
        if not live:
            return
        req = live[i % len(live)]
        if req.state == "granted":
            self.granted.remove(req)
        req.state = "hung_up"
        if self.core.leave(req.waiter, timed_out=False):
            self.dispatch(req.model)

    def tick(self, dt: float) -> None:
        self.now += dt
        due = sorted((q for q in self.reqs if q.state == "waiting" and q.deadline <= self.now),
                     key=lambda q: q.deadline)
        for req in due:
            self.core.leave(req.waiter, timed_out=True)
            req.state = "timed_out"

    def node(self, i: int, change: str, n: int) -> None:
        h = self.handles[i % len(self.handles)]
        if change == "lose":
            self.r.mark_lost(h, "test")
        elif change == "restore":
            self.r.apply_state(h, h.state)
        elif change == "pause":
            set_state(self.r, h, paused=not h.state.paused)
        elif change == "cordon":
            h.cordoned = not h.cordoned
            self.r.changed()
        elif change == "silent":
            # A change nobody announced (the registry's listeners were not called): the
            # core must still keep its order for new arrivals.
            h.cordoned = False
            if h.state.slots is not None:
                h.state.slots += 1
            if h.state.max_concurrency is not None:
                h.state.max_concurrency += 1
            self.stale = True
        elif change == "slots":
            set_state(self.r, h, slots=[None, 1, 2, 3][n % 4])
        elif change == "cap":
            set_state(self.r, h, max_concurrency=[None, 1, 2, 3][n % 4])
        elif change == "loading":
            models = [type(m)(name=m.name, state="loading" if m.state == "ready"
                              and m.name == MODELS[n % 2] else "ready")
                      for m in h.state.models]
            set_state(self.r, h, models=models)

    def drain(self) -> None:
        for h in self.handles:
            h.cordoned = False
        while self.granted or self.running:
            self.resume_all()
            while self.running:
                self.finish(0)
        self.tick(10_000)
        self.resume_all()
        while self.running:
            self.finish(0)


# Mostly bounded nodes (an unbounded one makes every wait vanish), mostly arrivals.
node_spec = st.one_of(st.tuples(st.sampled_from([1, 2]), st.sampled_from([None, 1, 2, 3])),
                      st.tuples(st.sampled_from([None, 1]), st.sampled_from([None, 1, 2])))
arrive = st.tuples(st.just("arrive"), st.sampled_from(MODELS), st.sampled_from(CLASSES))
step = st.one_of(
    arrive, arrive, arrive,
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("resume"), st.integers(0, 50)),
    st.tuples(st.just("hang_up"), st.integers(0, 50)),
    st.tuples(st.just("tick"), st.sampled_from([1.0, 10.0, 29.0, 31.0, 59.0, 61.0])),
    st.tuples(st.just("node"), st.integers(0, 3),
              st.sampled_from(["lose", "restore", "pause", "cordon", "cordon", "silent", "slots",
                               "cap", "loading"]), st.integers(0, 3)),
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(enabled=st.booleans(), reserve=st.integers(0, 3), max_depth=st.integers(0, 6),
       immediate=st.booleans(),
       nodes=st.lists(node_spec, min_size=1, max_size=3), steps=st.lists(step, min_size=10,
                                                                         max_size=100))
def test_admission_core_properties(enabled, reserve, max_depth, immediate, nodes, steps):
    sim = Sim(enabled=enabled, reserve=reserve, max_depth=max_depth, immediate=immediate,
              nodes=nodes)
    for op, *args in steps:
        getattr(sim, op)(*args)
        sim.check_nobody_waits_who_could_go()
    sim.drain()
    assert all(q.state in TERMINAL for q in sim.reqs), [(q.client, q.state) for q in sim.reqs]
    assert sim.core.queues == {}
    assert all(s.waiting == 0 for s in sim.core.classes.values())
    assert all(s.waiting == 0 for s in sim.core.models.values())
    waited = [q for q in sim.reqs if q.waiter is not None]
    stats = sim.core.classes
    assert sum(s.held for s in stats.values()) == len(waited)
    assert sum(s.timed_out for s in stats.values()) == sum(q.state == "timed_out" for q in sim.reqs)


fleet_node = st.tuples(st.sampled_from([None, 1, 2, 3]), st.sampled_from([None, 1, 2, 4]),
                       st.integers(0, 4),
                       st.integers(0, 3), st.booleans())


@settings(max_examples=300, deadline=None)
@given(nodes=st.lists(fleet_node, max_size=6), reserve=st.integers(0, 3), pending=st.integers(0, 3),
       cls=st.sampled_from(CLASSES))
def test_fast_count_equals_the_reference_and_its_early_stop_decides_the_same(nodes, reserve,
                                                                             pending, cls):
    from appliance.hub.decide.priority import count, ready_nodes
    handles = []
    for i, (slots, cap, mine, others, ready) in enumerate(nodes):
        h = handle(f"n{i}", slots=slots, max_concurrency=cap, models=("m1", "m2"),
                   model_state="ready" if ready else "loading")
        h.in_flight = {"m1": mine, "m2": others}
        h.in_flight_total = mine + others
        handles.append(h)
    full = fleet_of(handles, "m1")
    ready = ready_nodes(handles, "m1")
    assert count(ready, "m1") == full
    core = AdmissionCore(enabled=True, reserve=reserve, max_depth=10, max_wait=1,
                         background_max_wait=1)
    need = reserve + pending if cls == "background" else -1
    assert core.may_go(cls, count(ready, "m1", need, pending), pending) == core.may_go(cls, full,
                                                                                       pending)
