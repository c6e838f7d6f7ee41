"""The node's control API as the hub calls it (appliance/hub/fleet/ops.py) over the request
path's pool (appliance/client/upstream.py), against a real listener, plain and TLS: what
each call sends, how each answer reads, one kept-alive connection for them all."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from appliance.client.upstream import Pool, UpstreamError
from appliance.hub.fleet.nodes import Registry
from appliance.hub.fleet.ops import MAX_ANSWER_BYTES, NodeOps, NodeRefused, StaleLeader
from appliance.server.serve import serve
from appliance.wire import EPOCH_HEADER, HUB_HEADER, LEASE_HEADER, LoadRequest

SEEN: list[dict[str, Any]] = []


async def node(scope, receive, send):
    """A node's control API: loads answer 200, an unload of "held" 409 (a newer leader),
    pause 500 in the engine's words, epoch says 7, "big" a 1 MB error page."""
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    SEEN.append({"path": scope["path"], "headers": headers, "body": body,
                 "port": scope["client"][1]})
    path = scope["path"]
    status, answer = 200, b'{"ok": true}'
    if path.endswith("/held/unload"):
        status, answer = 409, b'{"error": {"message": "epoch 3 is older than 9"}}'
    elif path == "/node/v1/pause":
        status, answer = 500, b'{"error": {"message": "engine busy"}}'
    elif path == "/node/v1/epoch":
        answer = b'{"epoch": 7}'
    elif path.endswith("/big/load"):
        status, answer = 500, b"x" * (1 << 20)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": answer})


async def with_node(wire, fn) -> None:
    SEEN.clear()
    async with trio.open_nursery() as n:
        _, port = await n.start(lambda task_status: serve(
            node, "127.0.0.1:0", "node", task_status=task_status, **wire.serve_kwargs))
        reg = Registry()
        h, _ = reg.upsert("gpu", wire.url("127.0.0.1", port), static=True, token="own-token")
        pool = Pool(headers={"authorization": "Bearer shared"}, ssl_context=wire.ssl_context)
        try:
            await fn(NodeOps(pool, hub="hub-a"), h)
        finally:
            await pool.aclose()
            n.cancel_scope.cancel()


async def test_each_call_sends_its_orders_and_reads_its_answer(wire):
    async def calls(ops: NodeOps, h) -> None:
        ops.epoch, ops.lease = 3, 5.0
        await ops.load(h, "m/x", LoadRequest(), read_seconds=30)
        with pytest.raises(StaleLeader, match="epoch 3 is older than 9"):
            await ops.unload(h, "held")
        with pytest.raises(NodeRefused, match="engine busy") as e:
            await ops.control(h, "pause")
        assert e.value.status == 500
        await ops.assert_epoch(h)
        assert h.epoch == 7 and h.fenced == ""

    await with_node(wire, calls)
    load, unload, pause, epoch = SEEN
    assert load["path"] == "/node/v1/models/m/x/load"  # (m%2Fx on the wire)
    assert isinstance(json.loads(load["body"]), dict)  # the LoadRequest, as JSON
    assert load["headers"]["content-type"] == "application/json"
    for call in (load, unload, epoch):  # the orders carry who orders, and the fence
        hd = call["headers"]
        assert (hd[HUB_HEADER], hd[EPOCH_HEADER], hd[LEASE_HEADER]) == ("hub-a", "3", "5")
    for call in SEEN:  # the node's own token over the pool's shared one
        assert call["headers"]["authorization"] == "Bearer own-token"
    # One kept-alive connection for every call (the request path's pool, not a client of
    # its own): the same client port each time.
    assert len({c["port"] for c in SEEN}) == 1, [c["port"] for c in SEEN]


async def test_a_long_answer_is_read_only_so_far(wire):
    async def calls(ops: NodeOps, h) -> None:
        with pytest.raises(NodeRefused) as e:
            await ops.load(h, "big", LoadRequest(), read_seconds=30)
        assert e.value.status == 500 and len(str(e.value)) < 400

    assert MAX_ANSWER_BYTES < 1 << 20
    await with_node(wire, calls)


async def test_a_node_not_there_is_an_upstream_error():
    reg = Registry()
    with trio.socket.socket() as s:  # a port nobody listens on
        await s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h, _ = reg.upsert("gone", f"http://127.0.0.1:{port}", static=True)
    pool = Pool()
    try:
        with pytest.raises(UpstreamError, match="refused the connection"):
            await NodeOps(pool).control(h, "resume")
    finally:
        await pool.aclose()
