"""A request goes to at most two nodes (issue 22 item 7: a third tried when the limit is
two survived the suite, whose fleets had only two nodes): the Place's rule, and the
router's over three nodes that all fail before the first byte."""

from __future__ import annotations

import httpx
import trio

from appliance.hub.api import router
from tests.harness.admission_fleet import MODEL, handle, registry
from tests.harness.procs import free_port
from tests.hub.api.test_router import _hub, _static
from tests.hub.decide.test_admission import make


async def test_a_place_moves_once_and_never_to_a_third_node(autojump_clock):
    nodes = [handle("a"), handle("b"), handle("c")]
    r = registry(*nodes)
    adm, _ = make(r)
    async with adm.place(MODEL, "normal", "c") as p:
        first = p.node
        second = p.next(2)
        assert second is not None and second is not first
        assert p.next(2) is None and p.node is None  # a third node is free, and not taken
        assert len(p.tried) == 2 == len(set(p.tried))
        assert sum(h.in_flight_total for h in nodes) == 0  # every place given back
    assert sum(h.in_flight_total for h in nodes) == 0


async def test_the_router_tries_two_of_three_failing_nodes_then_answers_no_capacity(caplog):
    assert router.MAX_ATTEMPTS == 2
    async with trio.open_nursery() as nursery:
        hub, url, _stop = await _hub(nursery)
        for name in ("d1", "d2", "d3"):
            _static(hub, name, f"http://127.0.0.1:{free_port()}")
        async with httpx.AsyncClient(timeout=10) as c:
            r = await c.post(url + "/v1/chat/completions", json={"model": "m"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_capacity"
        said = [rec.getMessage() for rec in caplog.records
                if rec.name == "appliance.hub.api.router"]
        assert len(said) == 2, said
        assert "retried on d" in said[0] and said[1].endswith("has no other node to go to")
        nursery.cancel_scope.cancel()
