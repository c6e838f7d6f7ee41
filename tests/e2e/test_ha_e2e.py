"""Two hubs, one leader, a real etcd, real sim nodes: failover, shared state, fencing, etcd down.

One fleet for the module (etcd, hubs a and b, nodes n1 and n2 announcing to both), the
cases in order, each leaving the fleet whole for the next. Loads are counted at the nodes
(their "loading MODEL" log lines), not at the hubs, so "not tried again" means the node
never saw it. Lease 3 s: a dead leader is replaced within 3 + 2 s. A clean stop (SIGTERM)
has its own small fleet with a 30 s lease, so "handed over at once" cannot be confused
with "the lease ran out".
"""

from __future__ import annotations

import signal
import threading
import time
import urllib.parse

import httpx
import pytest

from tests.harness.etcd_proc import EtcdProc, needs_etcd
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = [pytest.mark.e2e, needs_etcd]

LEASE = 3
NODE_COUNT = 2  # n1 and n2, both able to run every model
TOKEN = "node-secret"
KEV = "unknown model architecture: 'kev'"
SIM = {
    "Sim__TokensPerSecond": "1000",  # 16 tokens by default: 16 ms; max_tokens=3000: 3 s
    "Sim__Models__0__Name": "ready-m", "Sim__Models__0__SizeMb": "100",
    "Sim__Models__1__Name": "kev-0.5b", "Sim__Models__1__SizeMb": "100",
    "Sim__Models__1__FailLoad": KEV,
    "Sim__Models__2__Name": "od-a", "Sim__Models__2__SizeMb": "100",
    "Sim__Models__2__LoadSeconds": "0.5",
    "Sim__Models__3__Name": "od-b", "Sim__Models__3__SizeMb": "100",
    "Sim__Models__4__Name": "od-c", "Sim__Models__4__SizeMb": "100",
    "Sim__Models__5__Name": "od-d", "Sim__Models__5__SizeMb": "100",
    "Sim__Models__6__Name": "od-e", "Sim__Models__6__SizeMb": "100",
}
CATALOG = {
    "Models__0__Name": "ready-m", "Models__0__Replicas": "2",
    "Models__1__Name": "kev-0.5b",
    "Models__2__Name": "od-a", "Models__3__Name": "od-b", "Models__4__Name": "od-c",
    "Models__5__Name": "od-d", "Models__6__Name": "od-e",
    "Models__RetryBackoffMaxSeconds": "0.3", "Router__ActivationWaitSeconds": "30",
    "Priority__Enabled": "true", "Priority__ReserveSlots": "1",
}


def ha_fleet(tmp, lease: int = LEASE) -> Fleet:
    """A fleet around one real etcd (`f.etcd`, closed with it): hubs and nodes by name."""
    f = Fleet(tmp, token=TOKEN)
    f.lease = lease
    f.etcd = EtcdProc(tmp / "etcd")
    f.etcd.start()
    closing = f.close

    def close() -> None:
        closing()
        f.etcd.close()
    f.close = close
    return f


def start_hub(f: Fleet, name: str, **env: str) -> None:
    f.start_hub({"Hub__Name": name, "Cluster__Etcd": f.etcd.url,
                 "Cluster__LeaseSeconds": str(f.lease), **CATALOG, **env}, name=name)


def start_node(f: Fleet, name: str, hubs: list[str], **env: str) -> None:
    f.start_node(name, {"Node__MemoryMb": "8000", "Node__AnnounceSeconds": "2", **SIM, **env},
                 hubs=hubs)


def cluster(f: Fleet, hub: str) -> dict:
    try:
        return f.status(hub)["cluster"]
    except httpx.HTTPError:
        return {}


def live(f: Fleet) -> list[str]:
    return [h for h, p in f.hubs.items() if p.popen.poll() is None]


def agreed_leader(f: Fleet) -> str:
    """The hub every live hub agrees leads (waits for agreement)."""
    def agreed():
        seen = {cluster(f, h).get("leader") for h in live(f)}
        return seen.pop() if len(seen) == 1 and None not in seen else None
    return wait_until(agreed, timeout=f.lease + 10, what="one leader agreed by every hub")


def ready(f: Fleet, hub: str, model: str) -> int:
    """How many replicas of `model` the hub says are ready."""
    return f.models(hub).get(model, {}).get("ready", 0)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = ha_fleet(tmp_path_factory.mktemp("ha"))
    try:
        start_hub(f, "hub-a")
        start_hub(f, "hub-b")
        start_node(f, "n1", ["hub-a", "hub-b"])
        start_node(f, "n2", ["hub-a"])  # announced to one hub only: the other learns it through etcd
        for h in ("hub-a", "hub-b"):
            wait_until(lambda h=h: ready(f, h, "ready-m") == 2, timeout=40,
                       what=f"ready-m ready twice on {h}")
        yield f
    finally:
        f.close()


def other(f: Fleet, hub: str) -> str:
    return next(h for h in f.hubs if h != hub)


class Hammer(threading.Thread):
    """Chats through one hub until stopped; what failed, and how many were sent."""

    def __init__(self, f: Fleet, hub: str) -> None:
        super().__init__(daemon=True)
        self.f, self.hub = f, hub
        self.failures: list[str] = []
        self.sent = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                r = self.f.chat("ready-m", hub=self.hub, timeout=20)
                if r.status_code != 200:
                    self.failures.append(r.text)
            except httpx.HTTPError as e:
                self.failures.append(repr(e))
            self.sent += 1

    def stop(self) -> None:
        self.halt.set()
        self.join()


def test_one_leader_shared_nodes_and_epoch(fleet):
    leader = agreed_leader(fleet)
    a, b = cluster(fleet, "hub-a"), cluster(fleet, "hub-b")
    assert a["epoch"] == b["epoch"] > 0 and a["hubs"] == b["hubs"] == ["hub-a", "hub-b"]
    assert [a["leading"], b["leading"]].count(True) == 1 and cluster(fleet, leader)["leading"]
    # n2 announced to hub-a only; hub-b dials it too.
    wait_until(lambda: {n["name"]: n["status"]
                        for n in fleet.status("hub-b")["nodes"]}.get("n2") == "up",
               what="n2 up on hub-b")
    _, said = fleet.ctl("status", hub=other(fleet, leader))
    assert f"cluster: leader {leader} (epoch {a['epoch']}); hubs hub-a, hub-b" in said, said
    m = httpx.get(fleet.hubs[leader].urls["metrics"] + "/metrics", timeout=10).text
    assert f'appliance_leader{{hub="{leader}"}} 1.0' in m and "appliance_cluster_up 1.0" in m
    m = httpx.get(fleet.hubs[other(fleet, leader)].urls["metrics"] + "/metrics", timeout=10).text
    assert f'appliance_leader{{hub="{other(fleet, leader)}"}} 0.0' in m


def test_a_forged_epoch_fences_a_node_for_one_lease_at_most_and_shows(fleet):
    # A node-token holder sends every node a forged epoch (and a year-long lease). The
    # leader neither steps down nor flaps; /api/status says which nodes refuse it; within
    # one lease of the last forgery the nodes take the leader's epoch again, and an
    # on-demand model loads.
    leader = agreed_leader(fleet)
    epoch = cluster(fleet, leader)["epoch"]
    for p in fleet.node_procs.values():
        r = httpx.post(f"{p.url}/node/v1/epoch", timeout=10,
                       headers={"authorization": f"Bearer {TOKEN}",
                                "x-appliance-epoch": "999999999999",
                                "x-appliance-lease": "31536000"})
        assert r.status_code == 200 and r.json()["epoch"] == 999999999999

    def fenced() -> dict[str, str]:
        return {n["name"]: n["fenced"] for n in fleet.status(leader)["nodes"] if n["fenced"]}

    wait_until(lambda: len(fenced()) == len(fleet.node_procs), timeout=5, what="nodes shown fenced")
    m = httpx.get(fleet.hubs[leader].urls["metrics"] + "/metrics", timeout=10).text
    assert 'appliance_node_fenced{node="n1"} 1.0' in m
    t0 = time.monotonic()
    assert fleet.chat("od-e", hub=leader, timeout=40).status_code == 200
    assert time.monotonic() - t0 < LEASE + 10
    wait_until(lambda: not fenced(), timeout=LEASE + 5, what="no node fenced")
    assert {n["epoch"] for n in fleet.status(leader)["nodes"]} == {epoch}
    assert cluster(fleet, leader)["epoch"] == epoch and cluster(fleet, leader)["leading"]


def test_forget_on_one_hub_forgets_on_all_until_it_announces_again(fleet):
    def n2_on(hub):
        return any(n["name"] == "n2" for n in fleet.status(hub)["nodes"])

    assert n2_on("hub-a") and n2_on("hub-b")
    r = httpx.delete(fleet.hubs["hub-b"].url + "/admin/nodes/n2",
                     timeout=10)  # n2 announces to hub-a only
    assert r.status_code == 200, r.text
    assert fleet.hubs["hub-a"].wait_stderr(r"node n2 forgotten \(by an operator on another hub\)",
                                           timeout=10)
    # n2's next announcement (to hub-a) brings it back on both.
    for h in ("hub-a", "hub-b"):
        wait_until(lambda h=h: ready(fleet, h, "ready-m") == 2, timeout=30,
                   what=f"n2 back on {h}")


def test_both_hubs_ask_at_once_one_load(fleet):
    """Two hubs take requests for an on-demand model at once: loaded exactly once."""
    results: list[int] = []

    def send(hub):
        results.append(fleet.chat("od-a", hub=hub, timeout=40).status_code)

    threads = [threading.Thread(target=send, args=(h,)) for h in ("hub-a", "hub-b", "hub-a",
                                                                  "hub-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 4
    assert fleet.loads("od-a") == 1


def test_priority_reserve_holds_across_hubs(fleet):
    """ready-m has one slot on each of two nodes. A long request through hub-a takes one;
    a background request through hub-b then finds only the reserved place left -- known
    from the node's own count, a heartbeat later -- and waits until the long one is done."""
    before = fleet.status("hub-b")["priority"]["background"]["held"]
    long = threading.Thread(target=lambda: httpx.post(
        fleet.hubs["hub-a"].url + "/v1/chat/completions", timeout=30,
        json={"model": "ready-m", "max_tokens": 3000, "messages": [{"role": "user",
                                                                    "content": "hi"}]}))
    long.start()
    wait_until(lambda: sum(n["in_flight"] for n in fleet.status("hub-b")["nodes"]) == 1, timeout=10,
               what="hub-b sees hub-a's request on the node")
    r = httpx.post(fleet.hubs["hub-b"].url + "/v1/chat/completions", timeout=30,
                   headers={"x-priority": "background"},
                   json={"model": "ready-m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert not long.is_alive() or fleet.status(
        "hub-b")["priority"]["background"]["held"] == before + 1
    long.join()
    assert fleet.status("hub-b")["priority"]["background"]["held"] == before + 1


def test_parked_is_shared_and_retry_reaches_the_leader(fleet):
    leader = agreed_leader(fleet)
    follower = other(fleet, leader)
    r = fleet.chat("kev-0.5b", hub=follower, timeout=40)
    assert r.status_code == 503 and r.json()[
        "error"]["code"] == "model_parked" and KEV in r.text, r.text
    # Five rounds, each a start on both nodes (a failed start is tried on the other capable
    # node before the round counts toward parking).
    assert fleet.loads("kev-0.5b") == 5 * NODE_COUNT
    for h in fleet.hubs:  # parked on both hubs, answered at once
        st = next(m for m in fleet.status(h)["models"] if m["name"] == "kev-0.5b")
        assert st["parked"] and st["consecutive_start_failures"] == 5 and st["last_error"] == KEV
        assert fleet.chat("kev-0.5b", hub=h, timeout=40).json()["error"]["code"] == "model_parked"
    # `ctl retry` on the follower: the leader tries it again (five more rounds at the nodes).
    r = httpx.post(fleet.hubs[follower].url + "/admin/models/kev-0.5b/retry", timeout=10)
    assert r.status_code == 200
    wait_until(lambda: fleet.loads("kev-0.5b") == 10 * NODE_COUNT, timeout=30,
               what="kev retried by the leader")
    wait_until(lambda: all(next(m for m in fleet.status(h)["models"]
                                if m["name"] == "kev-0.5b")["parked"]
                           for h in fleet.hubs), what="kev parked again on both hubs")


def test_kill_leader_failover(fleet):
    leader = agreed_leader(fleet)
    survivor = other(fleet, leader)
    t = Hammer(fleet, survivor)
    t.start()
    try:
        time.sleep(0.5)
        killed_at = time.monotonic()
        fleet.hubs[leader].signal(signal.SIGKILL)
        # A request that needs a load during the gap is served once the new leader places it.
        gap: list[httpx.Response] = []
        asker = threading.Thread(target=lambda: gap.append(fleet.chat("od-b", hub=survivor, timeout=40)))
        asker.start()
        # The lease runs out, then the survivor campaigns: slack for a busy 2-core box.
        wait_until(lambda: cluster(fleet, survivor).get("leading"), timeout=LEASE + 6, interval=0.05,
                   what="the survivor leads within LeaseSeconds + 6 s")
        took = time.monotonic() - killed_at
        asker.join()
        assert gap[0].status_code == 200, gap[0].text
        assert fleet.loads("od-b") == 1
        time.sleep(0.5)
    finally:
        t.stop()
    assert t.failures == [] and t.sent > 5, (t.failures, t.sent)
    assert took < LEASE + 6
    # Parked survives the failover: answered at once, the node never asked again.
    r = fleet.chat("kev-0.5b", hub=survivor, timeout=40)
    assert r.json()["error"]["code"] == "model_parked"
    assert fleet.loads("kev-0.5b") == 10 * NODE_COUNT
    start_hub(fleet, leader)  # back as a follower for the next cases
    wait_until(lambda: cluster(fleet, leader).get("leader") == survivor,
               what="restarted hub follows")


def test_sigstopped_leader_is_fenced(fleet):
    old = agreed_leader(fleet)
    new = other(fleet, old)
    old_epoch = cluster(fleet, old)["epoch"]
    fleet.hubs[old].signal(signal.SIGSTOP)
    try:
        wait_until(lambda: cluster(fleet, new).get("leading"), timeout=LEASE + 5,
                   what="a new leader")
        assert fleet.chat("od-c", hub=new, timeout=40).status_code == 200  # the nodes see the new epoch
    finally:
        fleet.hubs[old].signal(signal.SIGCONT)
    wait_until(lambda: cluster(fleet, old).get("leader") == new
               and not cluster(fleet, old)["leading"],
               what="the resumed hub follows")
    # Whatever the old leader still sends carries its old epoch: every node refuses it.
    node = next(p for n, p in fleet.node_procs.items() if any(
        m["name"] == "od-c" and m["state"] == "ready" for x in fleet.status(new)["nodes"]
        if x["name"] == n
        for m in x["models"]))
    r = httpx.post(f"{node.url}/node/v1/models/{urllib.parse.quote('od-c', safe='')}/unload",
                   timeout=10,
                   headers={"authorization": f"Bearer {TOKEN}",
                            "x-appliance-epoch": str(old_epoch)})
    assert r.status_code == 409 and r.json()["code"] == "stale_leader"
    assert fleet.hubs[old].wait_stderr("stepped down")


def test_etcd_down_ready_models_serve_placements_no_leader(fleet):
    fleet.etcd.stop()
    try:
        for h in fleet.hubs:
            wait_until(lambda h=h: cluster(fleet, h).get("leader") is None, timeout=LEASE + 5,
                       what=f"{h}: no leader")
        for h in fleet.hubs:
            assert fleet.chat("ready-m", hub=h, timeout=40).status_code == 200  # ready models keep serving
            r = fleet.chat("od-d", hub=h, timeout=40)  # a placement: no one may decide it
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_leader", r.text
            assert int(r.headers["retry-after"]) >= 1
    finally:
        fleet.etcd.start()
    agreed_leader(fleet)
    wait_until(lambda: all(cluster(fleet, h).get("etcd_up") for h in fleet.hubs),
               what="etcd up again")
    for h in fleet.hubs:  # service resumes by itself
        r = fleet.chat("od-d", hub=h, timeout=40)
        assert r.status_code == 200, (h, r.text, cluster(fleet, h))
    assert fleet.loads("od-d") == 1


LONG_LEASE = 30


def test_sigterm_of_the_leader_hands_over_at_once(tmp_path):
    """A leader stopped cleanly gives its lease up as its drain starts: the other hub leads
    (a new epoch) well before the 30 s lease could have run out -- while the stopped hub
    still finishes a request in flight -- requests through the new leader keep succeeding,
    and the stopped hub exits 0."""
    f = ha_fleet(tmp_path, lease=LONG_LEASE)
    try:
        # The sim's most tokens (4096) at 300/s: ~14 s in flight on the leader (within the
        # stopped hub's drain), so the handover (seconds on a loaded box) comes while it
        # still drains -- at 1000/s it was 4 s, once too short at load 9.5.
        start_hub(f, "hub-a", Hub__DrainSeconds="40")
        start_hub(f, "hub-b", Hub__DrainSeconds="40")
        start_node(f, "n1", ["hub-a", "hub-b"], Sim__TokensPerSecond="300")
        for h in f.hubs:
            wait_until(lambda h=h: ready(f, h, "ready-m") == 1, timeout=40,
                       what=f"ready-m ready on {h}")
        leader = agreed_leader(f)
        follower = other(f, leader)
        epoch = cluster(f, follower)["epoch"]
        long: list[httpx.Response] = []
        slow = threading.Thread(target=lambda: long.append(httpx.post(
            f.hubs[leader].url + "/v1/chat/completions", timeout=60,
            json={"model": "ready-m", "max_tokens": 4096,
                  "messages": [{"role": "user", "content": "hi"}]})))
        slow.start()
        t = Hammer(f, follower)
        t.start()
        try:
            wait_until(lambda: f.status(leader)["nodes"][0]["in_flight"] == 1, timeout=10,
                       interval=0.05, what="the long request on the node")
            stopped_at = time.monotonic()
            f.hubs[leader].signal(signal.SIGTERM)
            wait_until(lambda: cluster(f, follower).get("leading"), timeout=LONG_LEASE / 3,
                       interval=0.05, what="the follower leads before a third of the lease")
            took = time.monotonic() - stopped_at
            draining = slow.is_alive()
            assert f.hubs[leader].popen.wait(timeout=40) == 0
        finally:
            t.stop()
            slow.join()
        assert took < LONG_LEASE / 3
        assert draining, "the long request ended before the handover: the drain was not tested"
        assert long[0].status_code == 200, long[0].text  # finished by the draining ex-leader
        assert t.failures == [] and t.sent > 5, (t.failures, t.sent)
        after = cluster(f, follower)
        assert after["epoch"] > epoch and after["leader"] == follower
        assert after["hubs"] == [follower]  # the stopped hub's key went with its lease
        assert f.hubs[leader].wait_stderr(rf"hub {leader} stepped down .*this hub is stopping")
        assert f.hubs[follower].wait_stderr(rf"hub {follower} leads the fleet now")
    finally:
        f.close()
