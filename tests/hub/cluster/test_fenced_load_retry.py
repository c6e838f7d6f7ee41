"""A load refused by a node fenced with a forged epoch is asked again (issue 30 item 5).

A node-token holder sends the node `x-appliance-epoch: 999999999999`; the node refuses the
leader's loads until the forged epoch lapses (one lease, node/fence.py). The leader's load
of an on-demand model refused in that window must be asked again: the request is served
within one lease plus a load after the forgery stops, not left to time out at 45 s.
Fake etcd and fake node calls under trio's virtual clock (tests/hub/cluster/test_cluster.py).
"""

from __future__ import annotations

import trio

from appliance.hub.fleet.ops import StaleLeader
from tests.hub.cluster.test_cluster import LEASE, fleet


async def test_a_load_refused_as_stale_is_asked_again_once_the_forgery_stops(
        nursery, autojump_clock):
    store, a, b = await fleet(nursery, [{"Name": "m"}])
    real = a.ops.load
    forged_until = trio.current_time() + 8  # the forgery goes on for 8 s
    refused = []

    async def load(h, model, req, read_seconds):
        if trio.current_time() < forged_until:
            refused.append(trio.current_time())
            raise StaleLeader("epoch 3 is older than 999999999999: another hub leads now")
        await real(h, model, req, read_seconds)

    a.ops.load = load
    await a.control.activate("m")  # served: no model_loading after the activation wait
    assert refused and a.control.core.health["m"].failures == 0
    load_seconds = a.ops.load_seconds
    assert trio.current_time() <= forged_until + LEASE + load_seconds
    assert a.control.registry.ready_nodes("m")
