"""fit.choose over plain stand-ins of its protocols (no registry, no placement core): the
typed answers -- `Fit(node, victims)` or `NoFit(why)`."""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.hub.decide.fit import Fit, NoFit, choose
from appliance.wire import EngineInstall, ModelState, NodeState


@dataclass
class Spec:
    name: str
    source: str = ""
    memory_mb: int | None = None
    replicas: int = 0


@dataclass
class Node:
    name: str
    state: NodeState | None
    free: int | None
    in_flight: dict[str, int] = field(default_factory=dict)

    def routable(self) -> bool:
        return self.state is not None

    def status(self) -> str:
        return "up" if self.state is not None else "lost"

    def memory_free_mb(self) -> int | None:
        return self.free

    def kind(self) -> str:
        return "sim"


def node(name: str, free: int | None, models: dict[str, int]) -> Node:
    st = NodeState(name=name, engines=[EngineInstall("sim", "0.1")],
                   models=[ModelState(m, size, "ready") for m, size in models.items()])
    return Node(name, st, free)


SPECS = {"big": Spec("big", source="/m/big", memory_mb=900), "idle": Spec("idle")}


def test_the_most_free_node_that_fits() -> None:
    a, b = node("a", 1000, {}), node("b", 2000, {})
    got = choose(SPECS["big"], [a, b], set(), [], SPECS.__getitem__, lambda m: None)
    assert got == Fit(b, [])


def test_room_made_from_an_idle_on_demand_replica() -> None:
    a = node("a", 500, {"idle": 600})
    got = choose(SPECS["big"], [a], set(), [], SPECS.__getitem__, lambda m: 1.0)
    assert got == Fit(a, ["idle"])


def test_nowhere_is_a_reason_with_the_numbers() -> None:
    a = node("a", 500, {})
    assert choose(SPECS["big"], [a], set(), [], SPECS.__getitem__, lambda m: None) == NoFit(
        "needs 900 MiB; the most free is 500 MiB on a")
    lost = Node("c", None, None)
    assert choose(SPECS["big"], [lost], set(), [], SPECS.__getitem__, lambda m: None) == NoFit(
        "no node is up (c lost)")
