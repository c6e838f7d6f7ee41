"""Batches and stored responses on real llama.cpp servers (tests/conftest.py's
`real_server`): the official clients through a hub with a store and one llamacpp node --
a chat batch with a bad line, a Responses chain of five turns whose prompt the engine sees
grow, and an Anthropic message batch."""

from __future__ import annotations

import io
import json

import anthropic
import openai
import pytest

from tests.harness import make_gguf
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

@pytest.fixture(scope="module")
def hub(tmp_path_factory, real_server):
    tmp = tmp_path_factory.mktemp("store-real")
    tiny = make_gguf.write(tmp / "tiny.gguf", seed=11)
    f = Fleet(tmp)
    try:
        node = f.start_node("gpu", {"Engine__Kind": "llamacpp",
                                    "Engine__Command": real_server.command,
                                    "Engine__StartTimeoutSeconds": "60"}, announce=False)
        h = f.start_hub({"Nodes__0__Name": "gpu", "Nodes__0__Url": node.url,
                         "Models__0__Name": "tiny", "Models__0__Source": str(tiny),
                         "Router__ActivationWaitSeconds": "60",
                         "Store__Path": str(tmp / "state" / "store.db")}, metrics=False)
        f.wait_models("tiny")
        yield h
    finally:
        f.close()


def test_batch_chain_and_message_batch_on_a_real_engine(hub):
    c = openai.OpenAI(base_url=hub.url + "/v1", api_key="x", timeout=120, max_retries=0)
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "tiny", "max_tokens": 4,
                                  "messages": [{"role": "user", "content": f"hi {i}"}]}})
             for i in range(3)] + ["{broken"]
    f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                       purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    b = wait_until(lambda: (x := c.batches.retrieve(b.id)).status == "completed" and x,
                   timeout=180, what="batch completed")
    errs = c.files.content(b.error_file_id).text
    assert (b.request_counts.completed, b.request_counts.failed) == (3, 1), errs
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["r0", "r1", "r2"]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"]
               and o["response"]["body"]["usage"]["completion_tokens"] <= 4 for o in out)

    r = c.responses.create(model="tiny", input="turn 0", max_output_tokens=3)
    prompts = [r.usage.input_tokens]
    for i in range(1, 5):
        r = c.responses.create(model="tiny", input=f"turn {i}", previous_response_id=r.id,
                               max_output_tokens=3)
        prompts.append(r.usage.input_tokens)
    assert prompts == sorted(prompts) and len(set(prompts)) == 5  # the engine saw the chain
    assert c.responses.retrieve(r.id).output_text == r.output_text

    a = anthropic.Anthropic(base_url=hub.url, api_key="x", timeout=120, max_retries=0)
    mb = a.messages.batches.create(requests=[
        {"custom_id": f"m{i}", "params": {"model": "tiny", "max_tokens": 3,
                                          "messages": [{"role": "user", "content": "hi"}]}}
        for i in range(2)])
    wait_until(lambda: a.messages.batches.retrieve(mb.id).processing_status == "ended",
               timeout=180, what="message batch ended")
    results = list(a.messages.batches.results(mb.id))
    assert sorted(x.custom_id for x in results) == ["m0", "m1"]
    assert all(x.result.type == "succeeded" for x in results)
