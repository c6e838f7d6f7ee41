"""End to end on real llama.cpp servers: the hub's side of real engines (issue 20 items
2-4) with the official clients, through a hub and one `Engine__Kind=llamacpp` node, on
each server of tests/conftest.py's `real_server` (llama.cpp's own llama-server, then
llama-cpp-python's `python -m llama_cpp.server`; one not built here is skipped).

The model is tests/harness/make_gguf.py's tiny seeded GGUF: its words are noise, but counts,
caps, grammars and errors are the engine's own. Checked: `max_completion_tokens` caps the
answer (llama-cpp-python ignores it unmapped); structured output through every API
(`json_schema` fitted to what the server takes) is valid JSON of the schema; a stream's
usage is asked for and dropped unless the client asked; Ollama's counts and durations
over the translation; a body with no content type; an engine's refusal in the hub's
shape; answers name the model, never its file.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest
from pydantic import BaseModel, ConfigDict

from tests.harness import make_gguf
from tests.harness.fleet import Fleet
from tests.harness.llama_cache import RealServer

pytestmark = [pytest.mark.llamacpp, pytest.mark.e2e]

TOKEN = "real-engines-secret"
USER = [{"role": "user", "content": "hello there"}]
# A schema the tiny model's grammar-bound output completes in a few tokens.
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}
ROOM = 60  # tokens for a structured answer: `{ "a" :true }` and the grammar's whitespace


class Flag(BaseModel):
    model_config = ConfigDict(extra="forbid")
    a: bool


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, real_server: RealServer):
    tiny = make_gguf.write(tmp_path_factory.mktemp("gguf") / "tiny.gguf", seed=11)
    f = Fleet(token=TOKEN)
    f.python = real_server.name == "llama_cpp.server"
    try:
        node = f.start_node("gpu", {"Engine__Kind": "llamacpp",
                                    "Engine__Command": real_server.command,
                                    "Engine__StartTimeoutSeconds": "60"}, announce=False)
        f.start_hub({"Nodes__0__Name": "gpu", "Nodes__0__Url": node.url,
                     "Models__0__Name": "tiny", "Models__0__Source": str(tiny),
                     "Router__ActivationWaitSeconds": "60"}, metrics=False)
        f.wait_models("tiny")
        f.client = f.openai(key="x")
        yield f
    finally:
        f.close()


def test_max_completion_tokens_is_the_engines_cap(fleet):
    r = fleet.client.chat.completions.create(model="tiny", messages=USER,
                                             max_completion_tokens=5)
    # One answer is streamed from the engine (a client that leaves frees its slot) and
    # assembled: llama_cpp.server sends no usage in streams, so the hub counts its chunks.
    assert (0 < r.usage.completion_tokens <= 5 if fleet.python
            else r.usage.completion_tokens == 5) and r.choices[0].finish_reason == "length"
    assert r.model == "tiny"  # the model's name, not the server's file


def test_structured_output_on_every_api(fleet):
    parsed = fleet.client.chat.completions.parse(model="tiny", messages=USER,
                                                 response_format=Flag, max_tokens=ROOM)
    assert isinstance(parsed.choices[0].message.parsed, Flag)
    ol = ollama.Client(host=fleet.hub.url, timeout=60)
    got = ol.chat(model="tiny", messages=USER, format=SCHEMA, options={"num_predict": ROOM})
    Flag.model_validate_json(got.message.content)
    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="x", max_retries=0, timeout=60)
    m = ac.messages.create(model="tiny", max_tokens=ROOM, messages=USER,
                           output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    Flag.model_validate_json(m.content[0].text)
    resp = fleet.client.responses.create(model="tiny", input="hello", max_output_tokens=ROOM,
                                         text={"format": {"type": "json_schema", "name": "flag",
                                                          "schema": SCHEMA, "strict": True}})
    Flag.model_validate_json(resp.output_text)


def test_stream_usage_asked_for_and_dropped(fleet):
    plain = list(fleet.client.chat.completions.create(model="tiny", messages=USER, max_tokens=4,
                                                      stream=True))
    assert all(c.usage is None for c in plain)
    asked = list(fleet.client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    if fleet.python:
        pytest.skip("llama_cpp.server sends no usage in streams (it ignores include_usage)")
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4


def test_ollama_counts_and_durations(fleet):
    ol = ollama.Client(host=fleet.hub.url, timeout=60)
    whole = ol.chat(model="tiny", messages=USER, options={"num_predict": 6})
    last = list(ol.chat(model="tiny", messages=USER, options={"num_predict": 6},
                        stream=True))[-1]
    for r in (whole, last):
        # llama_cpp.server counts nothing in streams: the hub counts its chunks, and it
        # sends a token that ends inside a UTF-8 character with the next one.
        assert (0 < r.eval_count <= 6 if fleet.python else r.eval_count == 6)
        assert r.prompt_eval_count > 0
        parts = (r.load_duration, r.prompt_eval_duration, r.eval_duration)
        assert all(d > 0 for d in parts) and r.total_duration >= sum(parts)


def test_anthropic_and_responses_counts(fleet):
    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="x", max_retries=0, timeout=60)
    with ac.messages.stream(model="tiny", max_tokens=5, messages=USER) as s:
        start = next(e for e in s if e.type == "message_start")
        final = s.get_final_message()
    assert start.message.usage.input_tokens > 0
    assert (0 < final.usage.output_tokens <= 5 if fleet.python
            else final.usage.output_tokens == 5)
    r = fleet.client.responses.create(model="tiny", input="hello", max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (0 < r.usage.output_tokens <= 4 if fleet.python  # (streamed: as above)
            else r.usage.output_tokens == 4) and r.usage.input_tokens > 0


def test_no_content_type_and_engine_refusals(fleet):
    body = json.dumps({"model": "tiny", "messages": USER, "stream": False,
                       "options": {"num_predict": 3}})
    for path in ("/api/chat", "/v1/chat/completions"):
        r = httpx.post(fleet.hub.url + path, content=body, timeout=60,
                       headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200, r.text
    # A field the hub passes on and the engine refuses: the engine's words, one line.
    bad = httpx.post(fleet.hub.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": USER, "max_tokens": 3, "n_probs": "x", "top_k": "x"})
    assert 400 <= bad.status_code < 600, bad.text
    text = bad.text
    assert "Traceback" not in text and 'File "' not in text and "\n" not in bad.json()[
        "error"]["message"]
