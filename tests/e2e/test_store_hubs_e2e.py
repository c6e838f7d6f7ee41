"""Several hubs on a real etcd: any hub answers for an object another hub holds by asking
that hub (hub/store/peers.py); 503 `held_elsewhere` with Retry-After while it is down; a
turn continuing another hub's chain or conversation runs on that hub.

Two hubs, each with its own store, the same client keys; no nodes (files need none).
A file uploaded to hub-a is retrieved, read and deleted through hub-b; another key gets
the same 404 through either; a batch asked of hub-b over hub-a's file is made on hub-a,
and read and cancelled through hub-b; either hub lists both hubs' files and batches; once hub-a
has stopped, hub-b answers its ids 503 with Retry-After, and its own objects as before.
"""

from __future__ import annotations

import io
import signal

import httpx
import openai
import pytest

from tests.harness.etcd_proc import EtcdProc, needs_etcd
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = [pytest.mark.e2e, needs_etcd]

KEYS = {"Auth__RequireKeys": "true", "Auth__Clients__0__Name": "alice",
        "Auth__Clients__0__Key": "ka", "Auth__Clients__1__Name": "bob",
        "Auth__Clients__1__Key": "kb", "Models__0__Name": "m"}
LINE = (b'{"custom_id": "l1", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}\n')


def _fleet(tmp_path) -> tuple[Fleet, EtcdProc]:
    f = Fleet(tmp_path)
    etcd = EtcdProc(tmp_path / "etcd")
    etcd.start()
    for name in ("hub-a", "hub-b"):
        f.start_hub({"Hub__Name": name, "Cluster__Etcd": etcd.url, "Cluster__LeaseSeconds": "3",
                     "Store__Path": str(tmp_path / name / "store.db"), **KEYS}, name=name)
    return f, etcd


def test_a_chain_held_by_another_hub_is_continued_there(tmp_path):
    f, etcd = _fleet(tmp_path)
    try:
        f.start_node("n1", {"Sim__Models__0__Name": "m"}, hubs=["hub-a", "hub-b"])
        for h in ("hub-a", "hub-b"):
            f.wait_models("m", hub=h, timeout=40)
        a, b = f.openai("ka", hub="hub-a"), f.openai("ka", hub="hub-b")
        first = a.responses.create(model="m", input="one", max_output_tokens=4)
        second = _until(lambda: _continue(b, first.id), "hub-b sending the turn to hub-a")
        assert "hub-a" in second.id and second.previous_response_id == first.id
        items = b.responses.input_items.list(second.id, order="asc").data  # via hub-b too
        assert [i.content[0].text for i in items] == ["two"]
        conv = a.conversations.create()
        third = b.responses.create(model="m", input="three", conversation=conv.id,
                                   max_output_tokens=4)
        assert "hub-a" in third.id
        texts = [i.content[0].text for i in b.conversations.items.list(conv.id, order="asc").data
                 if i.role == "user"]
        assert texts == ["three"]
        with pytest.raises(openai.AuthenticationError):  # an unknown key is refused here
            f.openai("nobody", hub="hub-b").responses.create(
                model="m", input="x", previous_response_id=first.id)
    finally:
        f.close()
        etcd.close()


def test_any_hub_answers_for_another_hubs_objects(tmp_path):
    f, etcd = _fleet(tmp_path)
    try:
        a, b = f.openai("ka", hub="hub-a"), f.openai("ka", hub="hub-b")
        held = a.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
        assert "hub-a" in held.id
        # hub-b learns hub-a's URL from etcd within a tick or two
        got = _until(lambda: _retrieve(b, held.id), "hub-b answering")
        assert got.id == held.id and got.bytes == held.bytes
        assert b.files.content(held.id).content == LINE
        with pytest.raises(openai.NotFoundError):  # another key: the same 404 via either hub
            f.openai("kb", hub="hub-b").files.retrieve(held.id)
        # asked of hub-b, made on hub-a where its input file is
        batch = b.batches.create(input_file_id=held.id, endpoint="/v1/chat/completions",
                                 completion_window="24h")
        assert "hub-a" in batch.id and a.batches.retrieve(batch.id).id == batch.id
        # no node: its one line fails at once; hub-a answers the cancel of a finished batch
        wait_until(lambda: b.batches.retrieve(batch.id).status == "completed", timeout=30,
                   what="the batch completed, read through hub-b")
        with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
            b.batches.cancel(batch.id)
        assert b.files.delete(held.id).deleted
        with pytest.raises(openai.NotFoundError):
            a.files.retrieve(held.id)
        ours = b.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        kept = a.files.create(file=("in.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        # hub-a learns hub-b's URL from etcd too (nothing waited for it so far)
        _until(lambda: _retrieve(a, ours.id), "hub-a answering for hub-b's file")
        # a list asked of either hub holds both hubs' files, paged (after=) across them
        for client in (a, b):
            listed = [x.id for x in client.files.list(limit=1, purpose="batch")]
            assert {ours.id, kept.id} <= set(listed) and len(listed) == len(set(listed))
        assert [x.id for x in b.batches.list(limit=1)] == [batch.id]
        assert [x.id for x in f.openai("kb", hub="hub-b").files.list()] == []  # another key
        assert f.stop(f.hubs["hub-a"], signal.SIGTERM) == 0
        r = wait_until(lambda: _refused(f, kept.id), timeout=20, what="hub-a's id refused")
        assert r.json()["error"]["code"] == "held_elsewhere"
        assert float(r.headers["retry-after"]) > 0
        assert b.files.retrieve(ours.id).id == ours.id
    finally:
        f.close()
        etcd.close()


def _continue(client, prev):
    try:
        return client.responses.create(model="m", input="two", previous_response_id=prev,
                                       max_output_tokens=4)
    except openai.APIStatusError as e:
        assert e.status_code in (404, 503), e  # hub-a's URL not yet known to hub-b
        REFUSED.append(str(e))
        return None


def _retrieve(client, fid):
    try:
        return client.files.retrieve(fid)
    except openai.APIStatusError as e:
        assert e.status_code == 503, e  # not yet known: held elsewhere
        REFUSED.append(str(e))
        return None


# What a hub last answered while it did not reach the other: said when a wait runs out (the
# 503's message tells "is not running now" from "does not answer (...)").
REFUSED: list[str] = []


def _until(fn, what: str):
    try:
        return wait_until(fn, timeout=20, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}; the last refusal: {REFUSED[-1:]}") from None


def _refused(f: Fleet, fid: str) -> httpx.Response | None:
    r = httpx.get(f.hub_url("hub-b") + f"/v1/files/{fid}",
                  headers={"authorization": "Bearer ka"}, timeout=10)
    return r if r.status_code == 503 else None
