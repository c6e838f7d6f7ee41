"""End to end: stored responses, chains, background responses and conversations through a
real hub on the sim, with the official openai client -- and a restart keeps them."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest

from tests.e2e.test_store_e2e import ADMIN, Box
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e


def test_chain_of_five_turns_retrieve_input_items_and_ownership(procs, tmp_path):
    box = Box(procs, tmp_path)
    c = box.oai()
    r = c.responses.create(model="s-chat", input="turn 0", max_output_tokens=5)
    assert r.id.startswith("resp_") and r.store and r.previous_response_id is None
    ids, prompts = [r.id], [r.usage.input_tokens]
    for i in range(1, 5):
        r = c.responses.create(model="s-chat", input=f"turn {i}", previous_response_id=r.id,
                               max_output_tokens=5)
        assert r.previous_response_id == ids[-1]
        ids.append(r.id)
        prompts.append(r.usage.input_tokens)
    # the engine got the whole chain each turn: its prompt grew every time
    assert prompts == sorted(prompts) and len(set(prompts)) == 5
    got = c.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = list(c.responses.input_items.list(r.id))
    assert len(items) == 1 and items[0].content[0].text == "turn 4"
    # streamed, it is stored too, and the chain goes on from it
    with c.responses.create(model="s-chat", input="streamed", previous_response_id=r.id,
                            stream=True, max_output_tokens=5) as s:
        last = [ev for ev in s][-1]
    assert c.responses.retrieve(last.response.id).previous_response_id == r.id
    # each turn after the first was routed by its session (the chain's first id)
    turns = [a for a in box.audit() if a.get("path") == "/v1/responses"]
    assert [a.get("routing") for a in turns[1:]] == ["session"] * 5
    # store: false answers without keeping it
    gone = c.responses.create(model="s-chat", input="x", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(gone.id)
    # another key: the same 404 as for an id that never was, and no chaining onto it
    bob = box.oai("kb")
    for call in (lambda: bob.responses.retrieve(r.id), lambda: bob.responses.delete(r.id),
                 lambda: bob.responses.input_items.list(r.id),
                 lambda: bob.responses.create(model="s-chat", input="x",
                                              previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    # a restart keeps every response: the chain goes on
    box.hub.signal(signal.SIGTERM)
    box.hub.wait_exit()
    box.start()
    c = box.oai()
    nxt = c.responses.create(model="s-chat", input="after restart",
                             previous_response_id=r.id, max_output_tokens=5)
    assert nxt.usage.input_tokens > prompts[-1]
    c.responses.delete(ids[0])
    with pytest.raises(openai.NotFoundError):  # the chain is broken at its first turn
        c.responses.create(model="s-chat", input="x", previous_response_id=r.id)


def test_background_polled_cancel_and_conversations(procs, tmp_path):
    box = Box(procs, tmp_path, tps="20")
    c = box.oai()
    b = c.responses.create(model="s-chat", input="bg", background=True, max_output_tokens=5)
    assert b.status in ("queued", "in_progress") and b.background
    done = wait_until(lambda: (x := c.responses.retrieve(b.id)).status not in (
        "queued", "in_progress") and x, timeout=60, what="background response done")
    assert done.status in ("completed", "incomplete") and done.output_text
    slow = c.responses.create(model="s-chat", input="bg", background=True,
                              max_output_tokens=2000)
    assert c.responses.cancel(slow.id).status == "cancelled"
    wait_until(lambda: c.responses.retrieve(slow.id).status == "cancelled", what="cancelled")
    assert c.responses.cancel(done.id).status == done.status  # finished: as it was
    fore = c.responses.create(model="s-chat", input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):  # only background responses cancel
        c.responses.cancel(fore.id)

    conv = c.conversations.create(metadata={"topic": "t"},
                                  items=[{"type": "message", "role": "user",
                                          "content": "remember 7"}])
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "t"}
    r1 = c.responses.create(model="s-chat", input="hello", conversation=conv.id,
                            max_output_tokens=5)
    r2 = c.responses.create(model="s-chat", input="again", conversation=conv.id,
                            max_output_tokens=5)
    assert r2.usage.input_tokens > r1.usage.input_tokens
    items = list(c.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user")] + [
        ("message", "user"), ("message", "assistant")] * 2
    added = c.conversations.items.create(conv.id, items=[{"type": "message", "role": "user",
                                                          "content": "note"}])
    assert len(added.data) == 1
    assert c.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id).id \
        == added.data[0].id
    c.conversations.items.delete(added.data[0].id, conversation_id=conv.id)
    assert c.conversations.update(conv.id, metadata={"topic": "u"}).metadata == {"topic": "u"}
    with pytest.raises(openai.NotFoundError):
        box.oai("kb").conversations.retrieve(conv.id)
    admin = httpx.get(f"{box.hub.url}/v1/conversations/{conv.id}/items", timeout=10,
                      headers={"authorization": f"Bearer {ADMIN}"})
    assert admin.status_code == 200 and len(admin.json()["data"]) == 5
    assert c.conversations.delete(conv.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.list(conv.id)
    lines = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    background = [a for a in lines if a.get("path") == "/v1/responses" and a["status"] == 200
                  and a["client"] == "alice"]
    assert len(background) >= 4  # the background runs are audited like any request


def test_with_hub_workers_the_main_process_keeps_the_chain(procs, tmp_path):
    box = Box(procs, tmp_path, {"Hub__Workers": "2"})
    c = box.oai()
    r = c.responses.create(model="s-chat", input="one", max_output_tokens=4)
    for i in range(8):  # whichever process accepts it, the main one reads the store
        r = c.responses.create(model="s-chat", input=f"turn {i}", previous_response_id=r.id,
                               max_output_tokens=4)
    assert len(list(c.responses.input_items.list(r.id))) == 1
    assert c.responses.retrieve(r.id).previous_response_id is not None
