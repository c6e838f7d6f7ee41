"""Two hubs keep a conversation on one node through the nodes' word on where each key went
(appliance/hub/decide/shared.py, issue 27): plain code, two routers side by side."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hub.decide import affinity, shared
from appliance.hub.decide.affinity import Affinity
from appliance.hub.decide.cost import CostRouter
from appliance.wire import ModelState, NodeState, Routed

MODEL = "m"


@dataclass
class FakeNode:
    name: str
    left: int = 1  # places left for MODEL, as this hub counts them
    state: NodeState = field(default_factory=lambda: NodeState(
        name="x", slots=1, models=[ModelState(MODEL, state="ready")]))
    in_flight_total: int = 0
    others_total: int = 0

    def places_left(self, model: str) -> int | None:
        return self.left

    def has_concurrency(self) -> bool:
        return True


class Hub:
    """One hub's routing memory: affinity, cost, and the fold of what nodes say."""

    def __init__(self) -> None:
        self.affinity = Affinity()
        self.cost = CostRouter(10.0)
        self.fold = shared.Fold(self.cost.homes_of, self.affinity.index_of, self.cost.rates)

    def route(self, body: dict, headers: list[tuple[bytes, bytes]]):  # type: ignore[no-untyped-def]
        r = self.affinity.key(body, headers)
        r.size = len(str(body))
        return r


def conversation(turns: int, context: int = 4000) -> dict:
    msgs = [{"role": "system", "content": "context " * context}]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"question {t} " * 20},
                 {"role": "assistant", "content": f"answer {t} " * 20}]
    msgs.append({"role": "user", "content": "next " * 20})
    return {"model": MODEL, "messages": msgs}


def said(node: str, *keys: tuple[int, bytes]) -> NodeState:
    """`node`'s state saying it took requests with these (seq, header value)."""
    return NodeState(name=node, models=[ModelState(MODEL, state="ready")],
                     routed=[Routed(seq, MODEL, v.decode()) for seq, v in keys])


def test_the_other_hub_keeps_a_session_where_the_first_sent_it_even_when_full():
    a, b = Hub(), Hub()
    session = [(b"x-session-id", b"chat-1")]
    # Hub a sent turn 1 to gpu-c (the cold pick of a full fleet, not the rendezvous one).
    r1 = a.route(conversation(0), session)
    (header, value), = affinity.note(r1)
    assert header == b"x-appliance-route" and value.startswith(b"s")
    a.cost.learn(MODEL, r1, "gpu-c", service_s=0.5, first_s=0.4)
    # gpu-c says so on its watch stream; hub b folds it.
    assert b.fold.state("gpu-c", said("gpu-c", (1, value))) == 1
    # Turn 2 through hub b: gpu-c is busy (one place, taken), gpu-a and gpu-b are free.
    nodes = [FakeNode("gpu-a"), FakeNode("gpu-b"), FakeNode("gpu-c", left=0)]
    r2 = b.route(conversation(1), session)
    choice = b.cost.choose(MODEL, r2, nodes, b.affinity)
    assert choice is not None and choice.node == "gpu-c" and choice.home_wait > 0
    # Without the node's word hub b knows nothing of the session: a free node, elsewhere.
    c = Hub()
    r2 = c.route(conversation(1), session)
    assert c.cost.choose(MODEL, r2, nodes, c.affinity) is None  # the spread decides


def test_the_other_hub_finds_a_prompt_through_its_last_block():
    a, b = Hub(), Hub()
    r1 = a.route(conversation(0), [])
    assert r1.chain and r1.session is None
    (_, value), = affinity.note(r1)
    assert b.fold.state("gpu-b", said("gpu-b", (7, value))) == 1
    r2 = b.route(conversation(1), [])
    assert r2.chain[len(r1.chain) - 1] == r1.chain[-1]  # the next turn's chain holds it
    nodes = [FakeNode("gpu-a"), FakeNode("gpu-b", left=0), FakeNode("gpu-c")]
    choice = b.cost.choose(MODEL, r2, nodes, b.affinity)
    assert choice is not None and choice.node == "gpu-b"
    assert r2.reason == "prefix" and r2.matched == len(r1.chain)


def test_each_key_is_folded_once_and_a_restarted_node_counts_afresh():
    b = Hub()
    r = b.route(conversation(0), [(b"x-session-id", b"s")])
    (_, v), = affinity.note(r)
    st = said("gpu-a", (1, v), (2, v))
    assert b.fold.state("gpu-a", st) == 2
    assert b.fold.state("gpu-a", st) == 0  # the same state again (a heartbeat): nothing new
    assert b.fold.state("gpu-a", said("gpu-a", (2, v), (3, v))) == 1
    # The node restarted: its count begins again below what was seen.
    assert b.fold.state("gpu-a", said("gpu-a", (1, v))) == 1
    assert b.cost.homes_of(MODEL).get(r.session) == ("gpu-a", r.size // 4)


def test_a_peers_malformed_keys_are_skipped():
    b = Hub()
    bad = [b"s" + b"0" * 31 + b",5", b"s" + b"0" * 32 + b",-1", b"s" + b"0" * 32 + b",9" * 9,
           b"s" + b"0" * 32 + b",99999999", b"pxyz", b"p" + b"0" * 15, b"q" + b"0" * 16, b""]
    assert b.fold.state("gpu-a", said("gpu-a", *enumerate(bad, 1))) == 0
    assert not b.cost.homes and not b.affinity.index
    # A model the node does not serve is not remembered (its names are bounded by its state).
    good = affinity.note(b.route(conversation(0), []))[0][1]
    st = NodeState(name="gpu-a", routed=[Routed(9, "other", good.decode())])
    assert b.fold.state("gpu-a", st) == 0
    assert shared.parse("s" + "ab" * 16 + "," + str(shared.MAX_TOKENS + 1)) is None


def test_no_key_no_header():
    assert affinity.note(None) == []
    b = Hub()
    short = b.route({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, [])
    assert affinity.note(short) == []  # under one block: nothing to keep


def test_a_hub_without_answers_of_its_own_prices_the_home_at_the_nodes_time():
    """~3k tokens held at a busy home (one ahead), the other nodes free: at the default
    service time (2 s) the wait costs more than the 1.5 s of prefill saved -- it would move;
    at the node's word (0.3 s a request) it waits for its home."""
    session = [(b"x-session-id", b"chat-2")]
    nodes = [FakeNode("gpu-a"), FakeNode("gpu-b"), FakeNode("gpu-c", left=0)]
    for node_says, home in ((None, False), (300, True)):
        a, b = Hub(), Hub()
        r1 = a.route(conversation(0, 1500), session)
        (_, value), = affinity.note(r1)
        st = said("gpu-c", (1, value))
        st.models[0].service_ms = node_says
        b.fold.state("gpu-c", st)
        r2 = b.route(conversation(1, 1500), session)
        choice = b.cost.choose(MODEL, r2, nodes, b.affinity)
        assert choice is not None and (choice.node == "gpu-c") is home
    # Its own answers win, and later words of the node change nothing.
    b.cost.rates.observe("gpu-c", MODEL, service_s=1.0, first_s=None, uncached=None)
    b.fold.state("gpu-c", st)
    assert b.cost.rates.get("gpu-c", MODEL).service == 1.0
