"""A load refused while a node is fenced by a repeated forged epoch is asked again: the
request is served within one lease plus a load after the forgery stops (issue 30 item 5).
Real etcd, one hub, one sim node; the forger is this test, holding the node token, and
sends the forged epoch on its own (`/node/v1/epoch`) or, as the red team did, with a load
of another model. Both pass on the tree the red team attacked (2862194) as well: the
refused load is asked again there too (see the issue's note)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.e2e.test_ha_e2e import LEASE, TOKEN, agreed_leader, ha_fleet, start_hub, start_node
from tests.harness.etcd_proc import needs_etcd
from tests.harness.procs import wait_until

pytestmark = [pytest.mark.e2e, needs_etcd]
FORGERY_SECONDS = 6.0


@pytest.mark.parametrize("vector", ["epoch", "load"])
def test_a_load_refused_by_a_repeated_forgery_is_served_after_it(tmp_path, vector):
    f = ha_fleet(tmp_path)
    try:
        start_hub(f, "hub-a")
        start_node(f, "n1", ["hub-a"])
        leader = agreed_leader(f)
        wait_until(lambda: any(n["status"] == "up" for n in f.status(leader)["nodes"]),
                   timeout=30, what="n1 up")
        node = f.node_procs["n1"].url
        stop, fenced = threading.Event(), threading.Event()

        path = "epoch" if vector == "epoch" else "models/od-c/load"

        def forge() -> None:  # the forgery goes on, asserted every 0.3 s
            while not stop.is_set():
                httpx.post(f"{node}/node/v1/{path}", timeout=30, json={},
                           headers={"authorization": f"Bearer {TOKEN}",
                                    "x-appliance-epoch": "999999999999",
                                    "x-appliance-lease": "31536000"})
                fenced.set()  # the node took the forged epoch: a condition, not a pause
                time.sleep(0.3)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        assert fenced.wait(30), "the forgery never reached the node"
        t0 = time.monotonic()
        threading.Timer(FORGERY_SECONDS, stop.set).start()
        r = f.chat("od-b", hub=leader, timeout=60)  # asked while fenced: refused, asked again
        served = time.monotonic() - t0
        forger.join()
        assert r.status_code == 200, r.text
        # Not before the forgery ended (it fenced the node), and within one lease plus a
        # load (and slack for a busy machine) of its end -- not the 30 s activation wait.
        assert FORGERY_SECONDS <= served < FORGERY_SECONDS + LEASE + 10, served
    finally:
        f.close()
