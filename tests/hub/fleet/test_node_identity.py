"""Node identity: who may announce which name, where the hub may dial, and forgetting.

The decisions are plain functions (appliance/hub/fleet/announce.py) tested by calling them; the
forgetting of a ghost runs the real supervisor under MockClock against a node that never
answers.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from appliance.config import load
from appliance.http.errors import ApiError
from appliance.hub.fleet import announce
from appliance.hub.fleet.nodes import Registry
from appliance.hub.fleet.supervisor import supervise
from tests.harness.watch import answering


def auth(**env):
    return load(env).auth


def refused(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    return e.value


def test_no_token_configured_refuses_every_announcement_saying_what_to_set():
    e = refused(announce.authorize, auth(), "", "gpu-a")
    assert e.status == 401 and "set Auth__NodeToken" in e.message


def test_shared_token_announces_any_name_without_its_own_token():
    a = auth(Auth__NodeToken="shared", Auth__Nodes__0__Name="gpu-b", Auth__Nodes__0__Token="bee")
    assert announce.authorize(a, "shared", "gpu-a") is False  # allowed, not proven
    assert refused(announce.authorize, a, "wrong", "gpu-a").status == 401
    # gpu-b has its own token: the shared one may not announce it; its own proves it.
    assert refused(announce.authorize, a, "shared", "gpu-b").status == 401
    assert announce.authorize(a, "bee", "gpu-b") is True
    # ... and a per-node token announces only its own name.
    assert refused(announce.authorize, a, "bee", "gpu-a").status == 401


def test_per_node_tokens_alone_enable_announcements_for_those_names_only():
    a = auth(Auth__Nodes__0__Name="gpu-b", Auth__Nodes__0__Token="bee")
    assert announce.authorize(a, "bee", "gpu-b") is True
    assert refused(announce.authorize, a, "", "gpu-a").status == 401


@pytest.mark.parametrize("name", ["", "a" * 64, "a b", "../etc", "x\x00y", "node/3", "é"])
def test_bad_names_are_400_and_echo_at_most_200_chars(name):
    e = refused(announce.check_shape, name, "http://10.0.0.1:9090")
    assert e.status == 400 and "1 to 63" in e.message


def test_a_60kb_name_is_refused_and_not_echoed_whole():
    e = refused(announce.check_shape, "n" * 60_000, "http://10.0.0.1:9090")
    assert e.status == 400 and len(e.message) < 400


@pytest.mark.parametrize("url", [
    "http://10.0.0.1:9090/some/path", "http://10.0.0.1:9090/?q=1", "http://user:pw@10.0.0.1:9090",
    "http://10.0.0.1", "ftp://10.0.0.1:21", "http://10.0.0.1:99999", "http://10.0.0.1:9090#x",
    "10.0.0.1:9090",
])
def test_urls_with_path_query_credentials_or_no_port_are_400(url):
    assert refused(announce.check_shape, "gpu-a", url).status == 400


def test_good_shapes_pass():
    assert announce.check_shape("gpu-a.lab_1", "http://10.0.0.1:9090") == ("10.0.0.1", 9090)
    assert announce.check_shape("g", "https://[fd00::1]:443/") == ("fd00::1", 443)


def _handle(reg: Registry, name: str, url: str, static: bool = False, connected: bool = True):
    h, _ = reg.upsert(name, url, static)
    if connected:
        h.connected = True
        from appliance.wire import NodeState

        h.state = NodeState(name=name)
    return h


def test_a_reachable_node_keeps_its_name():
    reg = Registry()
    h = _handle(reg, "node3", "http://10.0.0.3:9090")
    e = refused(announce.check_identity, h, "http://127.0.0.1:19951", False, 1, 256)
    assert e.status == 409 and e.code == "node_name_taken"
    announce.check_identity(h, "http://10.0.0.3:9090", False, 1, 256)  # its own re-announcement
    announce.check_identity(h, "http://10.0.0.9:9090", True, 1,
                            256)  # proven by its own token: it moves


def test_a_lost_node_may_move_but_a_static_one_never():
    reg = Registry()
    lost = _handle(reg, "mover", "http://10.0.0.3:9090", connected=False)
    announce.check_identity(lost, "http://10.0.0.4:9090", False, 2, 256)
    static = _handle(reg, "fixed", "http://10.0.0.5:9090", static=True, connected=False)
    assert refused(announce.check_identity, static, "http://10.0.0.6:9090", True, 2,
                   256).status == 409


def test_beyond_max_nodes_a_new_name_is_503_with_retry_after():
    e = refused(announce.check_identity, None, "http://10.0.0.1:1", False, 3, 3)
    assert e.status == 503 and e.retry_after


@pytest.mark.parametrize("addrs,ok", [
    (["10.1.2.3"], True), (["127.0.0.1"], True), (["::1"], True), (["192.168.1.2"], True),
    (["fd12::1"], True),
    (["169.254.169.254"], False), (["fe80::1"], False), (["8.8.8.8"], False), (["10.0.0.1",
                                                                                "8.8.8.8"], False),
    (["0.0.0.0"], False), ([], False),
])
def test_addresses_must_lie_in_node_networks(addrs, ok):
    nets = load({}).hub.node_networks
    if ok:
        announce.check_addresses("h", addrs, nets)
    else:
        assert refused(announce.check_addresses, "h", addrs, nets).status in (400, 403)


def test_link_local_is_refused_even_when_configured():
    e = refused(announce.check_addresses, "meta", ["169.254.169.254"], ["169.254.0.0/16"])
    assert e.status == 403 and "Hub__NodeNetworks" in e.message


async def test_an_announced_ghost_is_forgotten_after_forget_seconds(autojump_clock):
    async def handler(request):
        raise httpx.ConnectError("refused")

    reg = Registry()
    ghost, _ = reg.upsert("ghost", "http://10.9.9.9:1", static=False)
    static, _ = reg.upsert("fixed", "http://10.9.9.8:1", static=True)
    events = []
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        client = answering(handler, nursery)
        for h in (ghost, static):
            nursery.start_soon(lambda h=h: supervise(
                client, h, reg, heartbeat=2.0, backoff_max=30.0, forget_after=600.0,
                on_event=lambda k, n, r: events.append((k, n.name,
                                                        trio.current_time() - start))))
        await trio.sleep(599)
        assert "ghost" in reg.nodes
        await trio.sleep(31)  # the next failed attempt after 600 s forgets it (backoff <= 30 s)
        assert "ghost" not in reg.nodes and ghost.removed
        assert "fixed" in reg.nodes  # static nodes are never forgotten
        nursery.cancel_scope.cancel()
    forgotten = [e for e in events if e[0] == "node_forgotten"]
    assert [e[1] for e in forgotten] == ["ghost"] and 600 <= forgotten[0][2] <= 630


async def test_forget_cancels_a_connected_supervisor(autojump_clock):
    async def handler(request):
        await trio.sleep_forever()

    reg = Registry()
    h, _ = reg.upsert("a", "http://10.0.0.1:1", static=False)
    async with trio.open_nursery() as node:  # the node's side, still answering
        client = answering(handler, node)
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: supervise(client, h, reg, heartbeat=2.0,
                                                     backoff_max=30.0,
                                                     on_event=lambda *a: None))
                await trio.sleep(1)
                reg.forget(h)
        node.cancel_scope.cancel()
    assert "a" not in reg.nodes
