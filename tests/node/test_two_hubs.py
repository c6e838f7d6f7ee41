"""Two hubs without etcd that both know a node fight over it (each loads what the other
unloads): the node notices two hub names giving it orders and says so -- in its log and in
its state (`NodeState.hubs`, the hub's /api/status `nodes[].hubs`). Issue 30 item 8."""

from __future__ import annotations

import logging

from appliance.node.fence import ORDERS_SECONDS, Orders
from appliance.wire import EPOCH_HEADER, HUB_HEADER
from tests.node.test_node_app import running_node


async def test_two_hubs_giving_orders_are_said(caplog):
    caplog.set_level(logging.WARNING)
    async with running_node() as n:
        for hub in ("hub-a", "hub-a", "hub-b"):
            r = await n.http.post("/node/v1/models/sim-small/load", headers={HUB_HEADER: hub})
            assert r.status_code == 200
        assert n.keeper.snapshot().hubs == ["hub-a", "hub-b"]
    assert "hubs hub-a, hub-b all give this node orders without Cluster__Etcd" in caplog.text


async def test_one_hub_or_an_ha_leader_is_no_fight(caplog):
    caplog.set_level(logging.WARNING)
    async with running_node() as n:
        await n.http.post("/node/v1/models/sim-small/load", headers={HUB_HEADER: "hub-a"})
        # With etcd, leaders change: orders carrying an epoch are the fence's business.
        await n.http.post("/node/v1/models/sim-small/load",
                          headers={HUB_HEADER: "hub-b", EPOCH_HEADER: "7"})
        assert n.keeper.snapshot().hubs == ["hub-a"]
    assert "give this node orders" not in caplog.text


def test_orders_forget_a_hub_after_a_while_and_stay_bounded():
    o = Orders()
    assert o.seen("a", 0.0) == ["a"]
    assert o.seen("a", 1.0) is None
    assert o.seen("b", 2.0) == ["a", "b"]
    assert o.seen("b", 2.0 + ORDERS_SECONDS) == ["b"]  # a gave none for a minute
    for i in range(100):
        o.seen(f"h{i}", 100.0)
    assert len(o.last) <= 8
