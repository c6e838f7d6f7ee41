"""A list merged over several hubs' stores (hub/api/peerlists.py, objects.merge): paged
through with the cursor an SDK sends back (the last id, held by one of the hubs), every
object comes once, in the order one store would give. The two hubs on a real etcd are
tests/e2e/test_store_hubs_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import trio

from appliance.config import load
from appliance.hub.api import peerlists
from appliance.hub.api.objects import AFTER_AT, merge, page_ask
from appliance.hub.store import peers
from appliance.hub.store.db import Db, Obj


def _hubs(tmp_path, spread: list[tuple[str, int]]) -> dict[str, Db]:
    """Objects named by their hub (`file-hub-a-N`) at the given creation times, some tied."""
    dbs = {h: Db(str(tmp_path / h / "store.db")) for h in ("hub-a", "hub-b", "hub-c")}
    for n, (hub, t) in enumerate(spread):
        dbs[hub].put(Obj(f"file-{hub}-{n:02d}", "file", "alice", t, None, 1, "", {}))
    return dbs


def _page(dbs: dict[str, Db], after: str | None, limit: int, newest: bool):
    """What the asked hub does: the cursor's time from the hub that holds it, then each
    store's page after it (placed by that time where the store does not hold it), merged."""
    at = None
    if after:
        holder = dbs["hub-" + after.split("-")[2]]
        at = holder.get("file", after, "alice").created_at
    pages = []
    for db in dbs.values():
        objs, more = db.page("file", "alice", after, limit, newest, "", (), at)
        pages.append(([{"id": o.id, "created_at": o.created_at} for o in objs], more))
    return merge(pages, limit, newest)


@pytest.mark.parametrize("limit", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("newest", [True, False])
def test_paging_a_merged_list_gives_every_object_once_in_order(tmp_path, limit, newest):
    spread = [("hub-a", 5), ("hub-b", 5), ("hub-c", 3), ("hub-a", 9), ("hub-b", 1),
              ("hub-b", 9), ("hub-c", 9), ("hub-a", 2), ("hub-c", 5), ("hub-a", 7)]
    dbs = _hubs(tmp_path, spread)
    want = sorted(((t, f"file-{h}-{n:02d}") for n, (h, t) in enumerate(spread)),
                  reverse=newest)
    got, after, more = [], None, True
    while more:
        data, more = _page(dbs, after, limit, newest)
        assert len(data) <= limit and (data or not more)
        got += [d["id"] for d in data]
        after = data[-1]["id"] if data else None
    assert got == [oid for _, oid in want]


def test_merge_keeps_a_hubs_has_more_and_cuts_at_the_limit():
    a = [{"id": "x-2", "created_at": 2}]
    b = [{"id": "y-3", "created_at": 3}, {"id": "y-1", "created_at": 1}]
    assert merge([(a, True), ([], False)], 5, True) == (a, True)
    data, more = merge([(a, False), (b, False)], 2, True)
    assert [d["id"] for d in data] == ["y-3", "x-2"] and more


def test_the_cursor_time_is_read_from_a_hub_and_bounded():
    def ask(value: bytes):
        return page_ask({"query_string": b"after=file-hub-b-1",
                         "headers": [(AFTER_AT, value)]})

    assert ask(b"1700000000").after_at == 1700000000
    assert ask(b"-5").after_at is None and ask(b"9" * 40).after_at is None
    assert ask(b"x").after_at is None


async def test_a_cursor_this_hub_holds_is_sent_on_with_its_time():
    # Each other hub places the cursor by its time alone: one of ours must carry it too
    # (without it they listed from the start again, and a page came twice).
    held = Obj("file-hub-b-01", "file", "alice", 42, None, 1, "", {})

    class Store:
        async def get(self, kind, oid, owner):
            return held if (kind, oid, owner) == ("file", held.id, "alice") else None

    hub = SimpleNamespace(cfg=load({"Hub__Name": "hub-b"}), cluster=object())
    plain = {"query_string": b"after=file-hub-b-01", "headers": []}
    ask = page_ask(plain)
    assert await peerlists.cursor_at(hub, plain, ask, Store(), "file", "file-", "alice") == 42
    sent = {"query_string": b"after=file-hub-c-01", "headers": [(peers.FROM, b"hub-c"),
                                                                 (AFTER_AT, b"7")]}
    assert await peerlists.cursor_at(hub, sent, page_ask(sent), Store(), "file", "file-",
                                     "alice") == 7  # the merging hub's word
    alone = SimpleNamespace(cfg=hub.cfg, cluster=None)
    assert await peerlists.cursor_at(alone, plain, ask, Store(), "file", "file-",
                                     "alice") is None  # one hub: its store places it


async def test_the_others_pages_are_merged_and_one_not_answering_is_left_out(autojump_clock):
    class Answer:
        status_code = 200

        def json(self):
            return {"data": [{"id": "file-hub-a-01", "created_at": 9}], "has_more": False}

    class Client:
        async def get(self, url, headers):
            if url.startswith("http://c"):
                await trio.sleep_forever()  # hub-c does not answer
            assert (AFTER_AT, b"5") in headers and url == "http://a/v1/files?after=x&limit=2"
            return Answer()

    hub = SimpleNamespace(cfg=load({"Hub__Name": "hub-b"}), peer_client=Client(),
                          cluster=SimpleNamespace(hub_urls=lambda: {
                              "hub-a": "http://a", "hub-b": "http://b", "hub-c": "http://c"}))
    scope = {"path": "/v1/files", "query_string": b"after=x&limit=2", "headers": []}
    mine = [{"id": "file-hub-b-01", "created_at": 3}]
    start = trio.current_time()
    data, more = await peerlists.merged(hub, scope, page_ask(scope), 5, mine, False)
    assert [d["id"] for d in data] == ["file-hub-a-01", "file-hub-b-01"] and not more
    assert trio.current_time() == start + peerlists.LIST_SECONDS
