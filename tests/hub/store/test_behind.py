"""Stored responses written behind (hub/store/behind.py): many puts, one transaction; a
read of a queued id finds it; a clean stop commits what is queued; a failed commit gives
its bytes back."""

from __future__ import annotations

import sqlite3

import trio
from prometheus_client import CollectorRegistry

from appliance.config import StoreConfig
from appliance.hub.store import behind
from appliance.hub.store.db import Obj
from appliance.hub.store.store import Store, open_store


def _store(tmp_path) -> Store:
    store = open_store(StoreConfig(path=str(tmp_path / "store.db")), "h", CollectorRegistry())
    assert store is not None
    return store


def _resp(i: int) -> Obj:
    return Obj(f"resp_h-{i}", "response", "a", 1, 2 ** 40, 10, "completed", {"n": i})


def _items(i: int) -> list:
    return [(f"msg_{i}_{k}", {"id": f"msg_{i}_{k}", "type": "message"}) for k in range(2)]


async def test_many_responses_one_transaction_and_each_read_back_at_once(tmp_path,
                                                                        autojump_clock):
    store = _store(tmp_path)
    groups: list[int] = []
    put_group = store.db.put_group
    store.db.put_group = lambda g: (groups.append(len(g)), put_group(g))[1]  # type: ignore
    async with trio.open_nursery() as nursery:
        await nursery.start(store.behind.run)
        for i in range(50):
            await store.put_behind(_resp(i), _items(i), b'{"n":%d}' % i)
        assert store.total == 500 and groups == []  # charged at once, not yet written
        assert len(store.behind.queued) == 50
        o = await store.get("response", "resp_h-7", "a")  # a reader commits its group
        assert o is not None and o.data == {"n": 7}
        assert groups == [50]
        items, _ = await store.run(store.db.items, "resp_h-7", None, 10, False)
        assert [x["id"] for x in items] == ["msg_7_0", "msg_7_1"]
        await store.put_behind(_resp(99), [], b'{}')
        t0 = trio.current_time()
        with trio.fail_after(60):  # no reader: committed once the group's time is up
            while store.behind.queued:
                await trio.sleep(0.01)
        assert trio.current_time() - t0 >= behind.GROUP_SECONDS and groups == [50, 1]
        nursery.cancel_scope.cancel()


async def test_a_clean_stop_commits_what_is_queued(tmp_path):
    store = _store(tmp_path)
    async with trio.open_nursery() as nursery:
        await nursery.start(store.behind.run)
        for i in range(3):
            await store.put_behind(_resp(i), _items(i), b'{"n":%d}' % i)
        nursery.cancel_scope.cancel()
    assert not store.behind.running
    got = [await store.run(store.db.get, "response", f"resp_h-{i}", "a") for i in range(3)]
    assert all(o is not None for o in got)
    await store.put_behind(_resp(5), [], b'{}')  # no writer now: written at once
    assert await store.run(store.db.get, "response", "resp_h-5", "a") is not None


async def test_a_failed_commit_gives_its_bytes_back(tmp_path):
    store = _store(tmp_path)

    def full(_g: list) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    store.db.put_group = full  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        await nursery.start(store.behind.run)
        await store.check_quota("a")
        await store.put_behind(_resp(1), [], b'{}')
        assert store.total == 10 and store.owned["a"] == 1
        assert await store.get("response", "resp_h-1", "a") is None
        assert store.total == 0 and store.owned["a"] == 0
        nursery.cancel_scope.cancel()
