"""Asking the hub that holds an object (hub/store/peers.py): this hub's URL as the others
read it from etcd, and which requests are sent on. The two hubs on a real etcd are
tests/e2e/test_store_hubs_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

from appliance.config import load
from appliance.hub.cluster import state
from appliance.hub.cluster.etcd import KV
from appliance.hub.store import ids, peers


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
