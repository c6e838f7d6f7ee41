"""The node's request record: one place taken and given back, one count, whatever ends it."""

from __future__ import annotations

import pytest

from appliance.bounds import OTHER_LABEL
from appliance.node.request import NodeRequest
from appliance.node.state import NoPlace


class Keeper:
    def __init__(self, refuse: str | None = None) -> None:
        self.refuse, self.in_flight = refuse, 0
        self.watchers = 1  # one hub: nothing said for the others (node/routed.py)

    def try_start(self, model: str) -> None:
        if self.refuse is not None:
            raise NoPlace(self.refuse)
        self.in_flight += 1

    def finish(self, model: str) -> None:
        self.in_flight -= 1


class Metrics:
    def __init__(self) -> None:
        self.counted: list[tuple[str, str]] = []

    def request(self, model: str, status: str) -> None:
        self.counted.append((model, status))


def test_a_served_request_gives_its_place_back_and_counts_once() -> None:
    keeper, metrics = Keeper(), Metrics()
    req = NodeRequest(keeper, metrics, "m")  # type: ignore[arg-type]
    req.start()
    assert keeper.in_flight == 1
    req.status = "200"
    req.finish("cancelled")
    req.finish("cancelled")
    assert keeper.in_flight == 0 and metrics.counted == [("m", "200")]


def test_a_refused_or_abandoned_request_is_counted_without_giving_back_a_place() -> None:
    keeper, metrics = Keeper(refuse="full"), Metrics()
    req = NodeRequest(keeper, metrics, "m")  # type: ignore[arg-type]
    with pytest.raises(NoPlace, match="full"):
        req.start()
    req.status = "503"
    req.finish("cancelled")
    assert keeper.in_flight == 0 and metrics.counted == [("m", "503")]
    keeper = Keeper()
    gone = NodeRequest(keeper, metrics, "m")  # type: ignore[arg-type]
    gone.start()
    gone.finish("client_gone")  # no status: the client went away before the last byte
    assert keeper.in_flight == 0 and metrics.counted[-1] == ("m", "client_gone")


def test_an_unknown_model_is_counted_under_the_other_label() -> None:
    metrics = Metrics()
    req = NodeRequest(Keeper(), metrics, "x" * 10_000)  # type: ignore[arg-type]
    req.unknown_model()
    req.status = "404"
    req.finish("cancelled")
    assert metrics.counted == [(OTHER_LABEL, "404")]
