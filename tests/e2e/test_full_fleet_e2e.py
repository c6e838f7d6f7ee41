"""End to end on a full fleet (issue 27): two sim nodes of one place each, both busy. The
next turn of each conversation goes to the node that holds its prompt -- the line there is
no longer than anywhere else, and its prefill is skipped -- where placing by free places
alone (the rule before) took either node. Status shows each node's places and the
predicted wait there."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

MODEL = "sim-small"
NODES = ("gpu-a", "gpu-b")


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    try:
        f.start_hub({"Audit__Path": f.audit_path})
        for n in NODES:
            # ~1,650-token contexts prefilled at 2,000 tokens/s: 0.8 s cold, a few ms warm
            f.start_node(n, {"Sim__Models__0__Name": MODEL, "Sim__Parallel": "1",
                             "Node__ModelSlots": "1", "Sim__TokensPerSecond": "50",
                             "Sim__PrefillTokensPerSecond": "2000",
                             "Node__AnnounceSeconds": "1"})
        for n in NODES:
            r = httpx.post(f.node(n).url + f"/node/v1/models/{MODEL}/load",
                           headers={"authorization": f"Bearer {f.token}"}, timeout=30)
            assert r.status_code == 200, r.text
        wait_until(lambda: f.ready_on(MODEL) == set(NODES), what="ready on both nodes")
        yield f
    finally:
        f.close()


def test_a_full_fleet_sends_each_turn_home(fleet):
    msgs = [[{"role": "system", "content": f"repository {i}: " + f"def f{i}(x): return x\n" * 300},
             {"role": "user", "content": "what does it do?"}] for i in range(2)]
    answers: dict[int, str] = {}

    def turn(i: int, messages: list, max_tokens: int) -> None:
        r = fleet.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        answers[i] = r.json()["choices"][0]["message"]["content"]

    def at_once(*calls: tuple) -> list[threading.Thread]:
        ts = [threading.Thread(target=turn, args=c) for c in calls]
        for t in ts:
            t.start()
        return ts

    # Turn 1 of both at once: one node each (the second finds the first's node full).
    for t in at_once((0, msgs[0], 4), (1, msgs[1], 4)):
        t.join(60)
    assert {x["node"] for x in fleet.audit("request")} == set(NODES)
    for i in range(2):
        msgs[i] = msgs[i] + [{"role": "assistant", "content": answers[i]},
                             {"role": "user", "content": "and then?"}]
    # A long answer of each (4 s): each goes home, both nodes busy.
    long = at_once((0, msgs[0], 200), (1, msgs[1], 200))
    wait_until(lambda: sum(n["in_flight"] for n in fleet.status()["nodes"]) == 2,
               what="both nodes busy")
    loads = [m for n in fleet.status()["nodes"] for m in n["models"] if m["name"] == MODEL]
    assert [(m["slots"], m["predicted_wait_ms"] > 0) for m in loads] == [(1, True)] * 2
    # Turn 2 of both while every node is full: each goes where its prompt is.
    second = at_once(*[(i, msgs[i] + [{"role": "assistant", "content": "..."},
                                      {"role": "user", "content": "more?"}], 4)
                       for i in range(2)])
    for t in long + second:
        t.join(60)
    lines = fleet.audit("request")
    assert len(lines) == 6 and all(x["status"] == 200 for x in lines)
    for x in lines[2:]:  # the long answers and the second turns: home, cached
        assert x["routing"] == "prefix" and x["cached_tokens"] > 0, x
