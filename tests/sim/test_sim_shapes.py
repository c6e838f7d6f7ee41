"""The sim behaves like an engine for what clients test first (issue 20 item 7): JSON output
valid against a given schema (OpenAI response_format, Ollama format), `n` choices,
log probabilities, a list of prompts, Ollama `think`; images and thinking refused by a
model that cannot do them. In-process sim on port 0."""

from __future__ import annotations

import json

import pytest

from appliance.config import SimModel
from appliance.sim import shape
from tests.sim.test_sim import CHAT, running_sim, sse_events

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 5},
    "age": {"type": "integer", "minimum": 18},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "home": {"$ref": "#/$defs/Place"},
    "nick": {"anyOf": [{"type": "null"}, {"type": "string"}]},
    "extra": {"type": "string"}},
    "required": ["name", "age", "kind", "tags", "home", "nick"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "zip": {"type": "integer",
                                                                 "maximum": 0}},
                        "required": ["city", "zip"]}}}
PERSON_VALUE = {"name": "simmm", "age": 19, "kind": "cat", "tags": ["sim", "sim"],
                "home": {"city": "sim", "zip": 0}, "nick": "sim"}


def test_a_minimal_instance_of_a_schema():
    assert shape.instance(PERSON) == PERSON_VALUE
    tree = {"$ref": "#/$defs/T", "$defs": {"T": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}, "minItems": 1}},
        "required": ["kids"]}}}
    assert json.dumps(shape.instance(tree))  # recursion is bounded
    assert shape.instance({"type": ["null", "number"], "exclusiveMinimum": 3}) == 4.5
    assert shape.instance({"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}},
                                      "required": ["a"]}]}) == {"a": True}


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_json_schema_and_json_object(stream):
    async with running_sim() as (_, c):
        for fmt, want in (({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                           PERSON_VALUE),
                          ({"type": "json_object"}, None)):
            r = await c.post("/v1/chat/completions",
                             json={**CHAT, "response_format": fmt, "stream": stream})
            assert r.status_code == 200
            if stream:
                text = "".join(e["choices"][0]["delta"].get("content") or ""
                               for e in sse_events(r.text)[:-1] if e["choices"])
            else:
                text = r.json()["choices"][0]["message"]["content"]
            got = json.loads(text)
            assert got == want if want is not None else isinstance(got["answer"], str)


async def test_ollama_format_json_and_schema_streamed_and_whole():
    async with running_sim() as (_, c):
        for fmt in ("json", PERSON):
            whole = (await c.post("/api/chat", json={**CHAT, "format": fmt,
                                                     "stream": False})).json()
            got = json.loads(whole["message"]["content"])
            assert got == PERSON_VALUE if fmt is PERSON else "answer" in got
            r = await c.post("/api/generate", json={"model": "sim-small", "prompt": "hi",
                                                    "format": fmt})
            lines = [json.loads(x) for x in r.text.splitlines()]
            assert json.loads("".join(x["response"] for x in lines))
            assert lines[-1]["done_reason"] == "stop"


async def test_n_choices_and_logprobs_on_chat():
    async with running_sim() as (_, c):
        body = {**CHAT, "n": 3, "logprobs": True, "top_logprobs": 2, "max_tokens": 5}
        r = (await c.post("/v1/chat/completions", json=body)).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2]
        texts = [ch["message"]["content"] for ch in r["choices"]]
        assert len(set(texts)) == 3 and r["usage"]["completion_tokens"] == 15
        lp = r["choices"][0]["logprobs"]["content"]
        assert len(lp) == 5 and "".join(t["token"] for t in lp) == texts[0]
        assert all(t["logprob"] < 0 and len(t["top_logprobs"]) == 2 for t in lp)
        assert lp[0]["top_logprobs"][0]["logprob"] > lp[0]["top_logprobs"][1]["logprob"]
        s = await c.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(s.text)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 15
        streamed = {0: "", 1: "", 2: ""}
        for e in events[:-2]:
            for ch in e["choices"]:
                streamed[ch["index"]] += ch["delta"].get("content") or ""
        assert [streamed[i] for i in range(3)] == texts


async def test_a_list_of_prompts_and_completion_logprobs():
    async with running_sim() as (_, c):
        r = (await c.post("/v1/completions", json={"model": "sim-small", "prompt": ["a", "b"],
                                                    "n": 2, "max_tokens": 3,
                                                    "logprobs": 2})).json()
        assert [ch["index"] for ch in r["choices"]] == [0, 1, 2, 3]
        lp = r["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 3 and lp["text_offset"][0] == 0
        assert all(len(t) == 2 for t in lp["top_logprobs"])
        one = (await c.post("/v1/completions", json={"model": "sim-small", "prompt": "b",
                                                      "max_tokens": 3})).json()
        assert len(one["choices"]) == 1
        bad = await c.post("/v1/completions", json={"model": "sim-small", "prompt": [{"x": 1}],
                                                     "n": 2})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        big = await c.post("/v1/completions", json={"model": "sim-small", "prompt": ["a"] * 65,
                                                     "n": 2})
        assert big.status_code == 400


async def test_ollama_think_gives_a_thinking_field():
    async with running_sim() as (_, c):
        whole = (await c.post("/api/chat", json={**CHAT, "think": True, "stream": False})).json()
        assert whole["message"]["thinking"] and whole["message"]["content"]
        lines = [json.loads(x) for x in (await c.post("/api/chat", json={
            **CHAT, "think": "high"})).text.splitlines()]
        thinking = "".join(x["message"].get("thinking", "") for x in lines)
        assert thinking == whole["message"]["thinking"]
        assert lines[0]["message"]["thinking"] and not lines[0]["message"]["content"]
        gen = (await c.post("/api/generate", json={"model": "sim-small", "prompt": "hi",
                                                   "think": True, "stream": False})).json()
        assert gen["thinking"] and gen["response"]
        plain = (await c.post("/api/chat", json={**CHAT, "think": False, "stream": False})).json()
        assert "thinking" not in plain["message"]


async def test_images_and_thinking_refused_by_a_model_that_cannot():
    models = [SimModel(name="text", capabilities=["completion"]),
              SimModel(name="eyes", capabilities=["completion", "vision"])]
    async with running_sim(models=models) as (_, c):
        img = {"role": "user", "content": "look", "images": ["aGk="]}
        r = await c.post("/api/chat", json={"model": "text", "messages": [img]})
        assert r.status_code == 400 and "does not support image input" in r.json()["error"]
        part = {"role": "user", "content": [{"type": "image_url",
                                             "image_url": {"url": "data:image/png;base64,aGk="}}]}
        r = await c.post("/v1/chat/completions", json={"model": "text", "messages": [part]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await c.post("/api/chat", json={"model": "text", "messages": [
            {"role": "user", "content": "x"}], "think": True})
        assert r.status_code == 400 and "does not support thinking" in r.json()["error"]
        ok = await c.post("/api/chat", json={"model": "eyes", "messages": [img],
                                             "stream": False})
        assert ok.status_code == 200
        show = (await c.post("/api/show", json={"model": "eyes"})).json()
        assert show["capabilities"] == ["completion", "vision"]
