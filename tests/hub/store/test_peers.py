"""Asking the hub that holds an object (hub/store/peers.py): this hub's URL as the others
read it from etcd (written, and kept through a late renewal, over the in-memory etcd of
tests/hub/cluster in virtual time), and which requests are sent on. The two hubs on a real etcd are
tests/e2e/test_store_hubs_e2e.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import trio

from appliance.config import load
from appliance.hub.cluster import state
from appliance.hub.cluster.etcd import KV
from appliance.hub.fleet.nodes import Registry
from appliance.hub.store import ids, peers
from tests.hub.cluster.test_cluster import LEASE, Hub, Store


def test_own_url_is_cluster_url_else_the_listener_as_bound():
    assert peers.own_url(load({"Cluster__Url": "https://a.lan:8443/"}),
                         ("0.0.0.0", 8080)) == "https://a.lan:8443"
    assert peers.own_url(load({}), ("127.0.0.1", 4321)) == "http://127.0.0.1:4321"
    assert peers.own_url(load({}), ("::1", 80)) == "http://[::1]:80"
    assert peers.own_url(load({}), ("0.0.0.0", 80)).endswith(":80")  # this host's name


def test_hub_keys_carry_their_url_and_garbage_is_skipped():
    k = state.Keys("app")
    s = state.parse(k, 9, [KV("app/hubs/hub-a", '{"name": "hub-a", "url": "http://a:1/"}',
                              1, 1, 1), KV("app/hubs/hub-b", "{}", 2, 2, 1),
                           KV("app/hubs/hub-c", '{"url": "file:///etc"}', 3, 3, 1),
                           KV("app/hubs/hub-d", "not json", 4, 4, 1)])
    assert s.hubs == ["hub-a", "hub-b", "hub-c", "hub-d"]
    assert s.hub_urls == {"hub-a": "http://a:1"}


def test_only_another_hubs_ids_are_sent_on_and_never_twice():
    cfg = load({"Hub__Name": "hub-b"})
    hub = SimpleNamespace(cfg=cfg, cluster=object())
    theirs, ours = ids.new("file-", "hub-a"), ids.new("file-", "hub-b")
    plain = {"headers": [(b"authorization", b"Bearer k")]}
    sent = {"headers": [(peers.FROM, b"hub-c")]}
    assert peers.elsewhere(hub, plain, theirs, "file-") == "hub-a"
    assert peers.elsewhere(hub, plain, ours, "file-") is None
    assert peers.elsewhere(hub, plain, "file-nonsense", "file-") is None
    assert peers.elsewhere(hub, plain, theirs, "batch_") is None  # not this route's kind
    assert peers.elsewhere(hub, sent, theirs, "file-") is None  # sent on once already
    assert peers.elsewhere(SimpleNamespace(cfg=cfg, cluster=None), plain, theirs,
                           "file-") is None  # one hub: nothing to ask


# --- the URLs the hubs publish and read, over the in-memory etcd in virtual time ----------


def test_a_url_is_kept_a_lease_after_its_key_went_and_replaced_at_once():
    p = state.PeerUrls(grace=3)
    p.read({"hub-a": "http://a:1", "hub-b": "http://b:1"}, now=10)
    p.read({"hub-b": "http://b:1"}, now=11)  # hub-a's renewal came late: its key went
    p.read({"hub-b": "http://b:2"}, now=13.9)
    assert p.urls == {"hub-a": "http://a:1", "hub-b": "http://b:2"}
    p.read({"hub-a": "http://a:1", "hub-b": "http://b:2"}, now=14)  # written again
    p.read({"hub-b": "http://b:2"}, now=20)  # gone again: counted from here
    assert p.urls["hub-a"] == "http://a:1"
    p.read({"hub-b": "http://b:2"}, now=23)
    assert p.urls == {"hub-b": "http://b:2"}


async def _two_hubs(nursery) -> tuple[Store, Hub, Hub]:
    store, registry = Store(), Registry()
    a, b = Hub("hub-a", store, registry, [{"Name": "m"}]), Hub("hub-b", store, registry,
                                                                [{"Name": "m"}])
    return store, a, b


async def test_a_url_advertised_while_the_first_write_is_answered_is_written_too(
        nursery, autojump_clock):
    # The hub's listener binds while its first hubs/NAME write (no URL yet) is on its way
    # back: the write is answered late (a loaded etcd) and `advertise` runs meanwhile. The
    # URL must still be written -- it was not, and the other hubs refused this hub's
    # objects as "not running now" until its lease was lost (test_store_hubs_e2e's
    # intermittent failure).
    store, a, b = await _two_hubs(nursery)
    a.etcd.answer["put"] = 0.2
    await a.start(nursery)
    await b.start(nursery)
    await trio.sleep(0.1)
    assert json.loads(store.kv["appliance/hubs/hub-a"].value)["url"] == ""
    a.member.advertise("http://a:1/")
    await trio.sleep(2)
    assert json.loads(store.kv["appliance/hubs/hub-a"].value)["url"] == "http://a:1"
    assert b.member.hub_urls()["hub-a"] == "http://a:1"


async def test_a_hub_whose_renewal_came_late_is_still_asked(nursery, autojump_clock):
    store, a, b = await _two_hubs(nursery)
    key = "appliance/hubs/hub-a"
    a.member.advertise("http://a:1")
    await a.start(nursery)
    await b.start(nursery)
    await trio.sleep(2)
    assert b.member.hub_urls()["hub-a"] == "http://a:1"
    lease = store.kv[key].lease
    a.etcd.answer["grant"] = 1.0  # its new lease is answered late (a loaded etcd)
    store.drop(lease)  # its renewal came late: etcd ended the lease and its key
    b_saw_none = False
    with trio.fail_after(LEASE):
        while key not in store.kv:  # until hub-a writes its key again
            await trio.sleep(0.05)
            b_saw_none = b_saw_none or "hub-a" not in b.member.snapshot.hubs
            assert b.member.hub_urls().get("hub-a") == "http://a:1"
    assert b_saw_none and store.kv[key].lease != lease


async def test_a_url_advertised_is_written_at_once_not_at_the_next_tick(nursery, autojump_clock):
    store, a, b = await _two_hubs(nursery)
    await a.start(nursery)
    await trio.sleep(0.1)  # its first write (no URL yet) done; the next tick is 0.4 s away
    a.member.advertise("http://a:1")
    await trio.sleep(0.1)
    assert json.loads(store.kv["appliance/hubs/hub-a"].value)["url"] == "http://a:1"
    written, renewals = store.kv["appliance/hubs/hub-a"].mod_revision, len(a.etcd.renewals)
    await trio.sleep(10 * a.member.tick)  # then a tick apart again, the URL not rewritten
    assert store.kv["appliance/hubs/hub-a"].mod_revision == written
    assert len(a.etcd.renewals) - renewals <= 11
