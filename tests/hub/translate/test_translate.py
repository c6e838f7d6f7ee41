"""The translations between API families, called with bytes (appliance/hub/translate)."""

from __future__ import annotations

import json

import pytest

from appliance.http.errors import ApiError
from appliance.hub.translate import (
    Converted,
    anthropic,
    engine_kind,
    ollama,
    prepare,
    resolve,
    responses,
)
from appliance.hub.translate.common import SSEReader
from appliance.hub.translate.errors import ErrorConverter
from appliance.hub.translate.usage import NDJSONMeter
from appliance.wire import EngineInstall, NodeState

PNG = "iVBORw0KGgo="


def sse(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n"
                    for o in objs) + b"data: [DONE]\n\n"


def chunk(content=None, finish=None, tool_calls=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
TOOL_STREAM = [
    chunk(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                       "function": {"name": "weather", "arguments": ""}}]),
    chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city": '}}]),
    chunk(tool_calls=[{"index": 0, "function": {"arguments": '"Paris"}'}}]),
    chunk(finish="tool_calls"), USAGE]


def feed_in_pieces(conv, data: bytes, size: int) -> bytes:
    out = b"".join(conv.feed(data[i:i + size]) for i in range(0, len(data), size))
    return out + conv.end()


def ticks():
    t = iter(range(0, 10**12, 1000))
    return lambda: next(t)


# --- Ollama onto OpenAI ------------------------------------------------------------------


def test_ollama_chat_request_maps_options_format_images_and_tools():
    body = {"model": "m", "stream": False, "format": "json", "keep_alive": "5m",
            "options": {"temperature": 0.2, "top_k": 5, "num_predict": 9, "stop": ["\n"], "seed": 4,
                        "num_ctx": 4096},
            "tools": [{"type": "function", "function": {"name": "weather",
                                                        "parameters": {"type": "object"}}}],
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "look", "images": [PNG]},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"function": {"name": "weather",
                                                       "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny", "tool_name": "weather"}]}
    req, stream = ollama.chat_request(body, "m:latest")
    # The engine streams whatever the client asked (the first token splits the durations).
    assert stream is False and req["stream"] is True
    assert req["stream_options"] == {"include_usage": True}
    assert req["model"] == "m:latest"
    assert (req["temperature"], req["top_k"], req["max_tokens"], req["stop"],
            req["seed"]) == (0.2, 5, 9, ["\n"], 4)
    assert "num_ctx" not in req and "keep_alive" not in req
    assert req["response_format"] == {"type": "json_object"}
    assert req["messages"][1]["content"] == [{"type": "text", "text": "look"},
                                             {"type": "image_url",
                                              "image_url": {"url": "data:image/png;base64," + PNG}}]
    call = req["messages"][2]["tool_calls"][0]
    assert call["function"] == {"name": "weather", "arguments": '{"city":"Paris"}'}
    assert req["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": call["id"]}
    assert req["tools"] == body["tools"]


def test_ollama_generate_request_streams_by_default_and_takes_a_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req, stream = ollama.generate_request({"model": "m", "prompt": "hi", "system": "sys",
                                           "format": schema}, "m")
    assert stream is True and req["stream_options"] == {"include_usage": True}
    assert req["messages"] == [{"role": "system", "content": "sys"}, {"role": "user",
                                                                      "content": "hi"}]
    assert req["response_format"]["json_schema"]["schema"] == schema


@pytest.mark.parametrize("body,param", [
    ({"messages": "x"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "options": {"temperature": "hot"}},
     "options.temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "format": 3}, "format"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
])
def test_ollama_chat_bad_bodies_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as ei:
        ollama.chat_request({"model": "m", **body}, "m")
    assert ei.value.status == 400 and ei.value.param == param


def test_ollama_chat_stream_becomes_ndjson_with_a_final_done_line_whatever_the_chunking():
    data = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               chunk("Hel"), chunk("lo"), chunk(finish="length"), USAGE)
    for size in (1, 7, len(data)):
        conv = ollama.ChatConverter("m", stream=True, chat=True, clock=ticks())
        lines = [json.loads(x) for x in feed_in_pieces(conv, data, size).splitlines()]
        assert [x["message"]["content"] for x in lines] == ["Hel", "lo", ""]
        assert [x["done"] for x in lines] == [False, False, True]
        last = lines[-1]
        assert last["done_reason"] == "length"
        assert (last["prompt_eval_count"], last["eval_count"]) == (7, 3)
        assert last["total_duration"] > 0 and last["total_duration"] == last[
            "load_duration"] + last["prompt_eval_duration"] + last["eval_duration"]


def test_ollama_stream_gathers_tool_call_pieces_into_one_call():
    conv = ollama.ChatConverter("m", stream=True, chat=True)
    lines = [json.loads(x) for x in feed_in_pieces(conv, sse(*TOOL_STREAM), 5).splitlines()]
    calls = [x["message"]["tool_calls"] for x in lines if x["message"].get("tool_calls")]
    assert calls == [[{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]]
    assert lines[-1]["done"] is True and lines[-1]["done_reason"] == "stop"


def test_ollama_whole_answers_chat_and_generate():
    body = json.dumps({"choices": [{"index": 0, "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": "Hi"}}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": 1},
                       "timings": {"prompt_ms": 1.5, "predicted_ms": 2.0}}).encode()
    conv = ollama.ChatConverter("m", stream=False, chat=False)
    out = json.loads(feed_in_pieces(conv, body, 3))
    assert out["response"] == "Hi" and out["done"] is True and out["done_reason"] == "stop"
    assert (out["prompt_eval_duration"], out["eval_duration"], out["eval_count"]) == (1_500_000,
                                                                                      2_000_000, 1)
    assert conv.content_type == b"application/json"


def test_ollama_embed_and_legacy_embeddings():
    req = ollama.embed_request({"model": "e", "input": ["a", "b"]}, "e:latest", legacy=False)
    assert req == {"model": "e:latest", "input": ["a", "b"]}
    assert ollama.embed_request({"model": "e", "prompt": "a"}, "e", legacy=True)["input"] == "a"
    body = json.dumps({"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
                       "usage": {"prompt_tokens": 4}}).encode()
    conv = ollama.EmbedConverter("e", legacy=False)
    conv.feed(body)
    out = json.loads(conv.end())
    assert out["embeddings"] == [[1.0], [2.0]] and out["prompt_eval_count"] == 4
    legacy = ollama.EmbedConverter("e", legacy=True)
    legacy.feed(body)
    assert json.loads(legacy.end()) == {"embedding": [1.0]}


# --- who translates what -----------------------------------------------------------------


def test_prepare_passes_native_bytes_through_and_translates_for_openai_engines():
    body = b'{"model":"m","messages":[{"role":"user","content":"x"}],  "stream": false}'
    prep = prepare("/api/chat", "ollama", body, "m", "m")
    for kind in ("ollama", "sim", ""):
        p = prep.for_engine(kind)
        assert (p.path, p.body) == ("/api/chat", body)
        assert isinstance(p.converter(200, "application/x-ndjson"), NDJSONMeter)
    for kind in ("llamacpp", "openai"):
        p = prep.for_engine(kind)
        assert p.path == "/v1/chat/completions" and json.loads(
            p.body)["messages"] == [{"role": "user", "content": "x"}]
        assert isinstance(p.converter(200), ollama.ChatConverter)
        assert isinstance(p.converter(500), ErrorConverter)
    chat = (b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,'
            b'"stream_options":{"include_usage":true}}')
    assert prepare("/v1/chat/completions", "openai", chat, "m",
                   "m").for_engine("llamacpp").body == chat
    # A name the hub resolved is written into the forwarded body.
    p = prepare("/v1/chat/completions", "openai", chat, "m", "m:latest").for_engine("ollama")
    assert json.loads(p.body)["model"] == "m:latest"


def test_prepare_refuses_bad_types_at_once_and_missing_fields_for_openai_engines_only():
    with pytest.raises(ApiError) as ei:
        prepare("/v1/chat/completions", "openai", b'{"model":"m","messages":"x"}', "m", "m")
    assert ei.value.param == "messages"
    with pytest.raises(ApiError) as ei:
        prepare("/v1/chat/completions", "openai",
                b'{"model":"m","messages":[{"role":"user"}],"temperature":"hot"}', "m", "m")
    assert ei.value.param == "temperature"
    prep = prepare("/v1/chat/completions", "openai", b'{"model":"m"}', "m", "m")
    assert json.loads(prep.for_engine("sim").body) == {  # streamed, assembled by the hub
        "model": "m", "stream": True, "stream_options": {"include_usage": True}}
    with pytest.raises(ApiError) as ei:
        prep.for_engine("llamacpp")
    assert ei.value.status == 400 and ei.value.param == "messages"
    embed = prepare("/api/embed", "ollama", b'{"model":"m"}', "m", "m")
    assert embed.for_engine("ollama").path == "/api/embed"
    with pytest.raises(ApiError):
        embed.for_engine("openai")
    with pytest.raises(ApiError) as ei:
        prepare("/v1/messages", "anthropic",
                b'{"model":"m","messages":[{"role":"user","content":"x"}]}', "m", "m")
    assert ei.value.param == "max_tokens"


def test_ollama_load_request_on_an_openai_engine_answers_done_load():
    p = prepare("/api/generate", "ollama", b'{"model":"m"}', "m", "m").for_engine("llamacpp")
    assert json.loads(p.body)["max_tokens"] == 1
    conv = p.converter(200)
    conv.feed(json.dumps({"choices": [{"message": {"content": "tok"},
                                       "finish_reason": "length"}]}).encode())
    out = json.loads(conv.end())
    assert (out["response"], out["done"], out["done_reason"]) == ("", True, "load")


@pytest.mark.parametrize("think,want", [
    (True, {"chat_template_kwargs": {"enable_thinking": True}}),
    (False, {"chat_template_kwargs": {"enable_thinking": False}}),
    ("high", {"reasoning_effort": "high",
              "chat_template_kwargs": {"enable_thinking": True, "reasoning_effort": "high"}}),
])
def test_ollama_think_maps_to_the_engines_switches(think, want):
    for req, _ in (ollama.chat_request({"messages": [{"role": "user", "content": "x"}],
                                        "think": think}, "m"),
                   ollama.generate_request({"prompt": "x", "think": think}, "m")):
        assert {k: req[k] for k in want} == want
    plain, _ = ollama.chat_request({"messages": [{"role": "user", "content": "x"}]}, "m")
    assert "chat_template_kwargs" not in plain and "reasoning_effort" not in plain


@pytest.mark.parametrize("body,param", [({"think": "very"}, "think"),
                                        ({"options": {"num_ctx": "big"}}, "options.num_ctx")])
def test_ollama_think_and_num_ctx_bad_values_are_400(body, param):
    with pytest.raises(ApiError) as ei:
        ollama.chat_request({"messages": [{"role": "user", "content": "x"}], **body}, "m")
    assert ei.value.status == 400 and ei.value.param == param


def test_ollama_reasoning_content_comes_back_as_thinking():
    whole = json.dumps({"choices": [{"finish_reason": "stop", "message": {
        "content": "42", "reasoning_content": "let me see"}}]}).encode()
    for chat in (True, False):
        out = json.loads(feed_in_pieces(ollama.ChatConverter("m", False, chat), whole, 5))
        if chat:
            assert out["message"] == {"role": "assistant", "content": "42",
                                      "thinking": "let me see"}
        else:
            assert (out["response"], out["thinking"]) == ("42", "let me see")
    think = {"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"},
                          "finish_reason": None}]}
    conv = ollama.ChatConverter("m", stream=True, chat=True)
    lines = [json.loads(x) for x in feed_in_pieces(conv, sse(think, chunk("42"), USAGE),
                                                   6).splitlines()]
    assert [(x["message"]["content"], x["message"].get("thinking")) for x in lines] == [
        ("", "hmm"), ("42", None), ("", None)]
    plain = json.loads(feed_in_pieces(ollama.ChatConverter("m", False, True), json.dumps(
        {"choices": [{"message": {"content": "a"}}]}).encode(), 4))
    assert "thinking" not in plain["message"]


def _chat(text: str, **options) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}],
                       "options": options}).encode()


def test_ollama_num_predict_past_the_engines_context_is_a_400_on_openai_engines():
    # The prompt counts at its least possible size: one token per 64 bytes of text.
    assert ollama.context_floor({"max_tokens": 100, "messages": [
        {"role": "user", "content": "x" * 640}, {"role": "user", "content": [
            {"type": "text", "text": "y" * 64}, {"type": "image_url"}]}]}) == 111
    assert ollama.context_floor({"messages": [{"role": "user", "content": "x"}]}) == 0
    prep = prepare("/api/chat", "ollama", _chat("x" * 640, num_predict=4000, num_ctx=8192),
                   "m", "m")
    assert json.loads(prep.for_engine("llamacpp", 8192).body)["max_tokens"] == 4000
    assert "num_ctx" not in json.loads(prep.for_engine("openai", 4010).body)
    prep.for_engine("llamacpp", 0)  # context unknown: the engine decides
    for kind in ("llamacpp", "openai"):
        with pytest.raises(ApiError) as ei:
            prep.for_engine(kind, 4009)
        assert ei.value.status == 400 and ei.value.param == "options.num_predict"
        assert "4010" in ei.value.message and "4009" in ei.value.message
    # Ollama itself sizes its context per request (num_ctx): the body passes as it is.
    assert prep.for_engine("ollama", 4009).body == prep.body
    # A load request or one without num_predict is never refused for its length.
    prepare("/api/generate", "ollama", b'{"model":"m"}', "m", "m").for_engine("llamacpp", 1)
    prepare("/api/chat", "ollama", _chat("x" * 100000), "m", "m").for_engine("llamacpp", 100)


@pytest.mark.parametrize("make", [
    lambda extra: anthropic.request({"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}], **extra}, "m")[0],
    lambda extra: responses.request({"input": "x", **extra}, "m")[0],
])
def test_anthropic_and_responses_sampling_fields_through_one_helper(make):
    req = make({"temperature": 0.2, "top_p": 1})
    assert (req["temperature"], req["top_p"]) == (0.2, 1)
    assert "temperature" not in make({}) and "top_p" not in make({"temperature": 0})
    for bad_body, param in (({"temperature": "hot"}, "temperature"), ({"top_p": True}, "top_p")):
        with pytest.raises(ApiError) as ei:
            make(bad_body)
        assert ei.value.status == 400 and ei.value.param == param


def test_resolve_latest_both_ways():
    names = {"llama3.2:latest", "plain", "org/x:latest"}
    assert resolve("llama3.2", names.__contains__) == ("llama3.2:latest", True)
    assert resolve("plain:latest", names.__contains__) == ("plain", True)
    assert resolve("org/x", names.__contains__) == ("org/x:latest", True)
    assert resolve("nope", names.__contains__) == ("nope", False)
    assert resolve("llama3.2:1b", names.__contains__) == ("llama3.2:1b", False)


def test_engine_kind_and_error_converter_and_sse_reader():
    assert engine_kind(None) == "" and engine_kind(NodeState(name="n")) == ""
    assert engine_kind(NodeState(name="n", engines=[EngineInstall("llamacpp")])) == "llamacpp"
    conv = ErrorConverter("ollama", 404)
    conv.feed(b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}')
    assert json.loads(conv.end()) == {"error": "File Not Found"}
    conv = ErrorConverter("anthropic", 500)
    conv.feed(b'{"detail":"boom"}')
    assert json.loads(conv.end()) == {"type": "error", "error": {"type": "api_error",
                                                                 "message": "boom"}}
    r = SSEReader()
    assert r.feed(b"data: {\"a\"") == [] and r.feed(
        b":1}\r\n\r\nevent: x\ndata: [DONE]\n") == [b'{"a":1}', b"[DONE]"]


async def test_converted_hands_out_converted_chunks_and_the_tail():
    class Body:  # a node's answer, read by read (appliance.client.upstream.Response's receive)
        read_timeout, waited_at = 5.0, 0.0

        def __init__(self) -> None:
            self.reads = [b"data: " + json.dumps(chunk("a")).encode(), b"\n\n",
                          b"data: [DONE]\n\n"]

        async def receive(self) -> bytes:
            return self.reads.pop(0) if self.reads else b""

        async def timed_out(self) -> Exception:
            return TimeoutError()

    relay = Converted(Body(), ollama.ChatConverter("m", stream=True, chat=True))
    got = []
    while out := await relay.receive():
        got.append(out)
    assert relay.ended and json.loads(got[0])["message"]["content"] == "a"
    assert json.loads(got[-1].splitlines()[-1])["done"] is True
    assert await relay.receive() == b""  # and it stays ended


# --- Anthropic Messages ------------------------------------------------------------------


def test_anthropic_request_maps_system_tools_and_tool_results():
    body = {"model": "m", "max_tokens": 50, "system": [{"type": "text", "text": "sys"}],
            "stop_sequences": ["END"],
            "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
            "messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": [{"type": "text", "text": "checking"},
                                                           {"type": "tool_use", "id": "tu1",
                                                            "name": "weather",
                                                            "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                                       "content": "sunny"},
                                                      {"type": "text", "text": "thanks"}]}]}
    req, stream = anthropic.request(body, "m")
    assert stream is False and req["max_tokens"] == 50 and req["stop"] == ["END"]
    assert req["tool_choice"] == "required"
    assert req["tools"][0]["function"] == {"name": "weather", "description": "d",
                                           "parameters": {"type": "object"}}
    assert req["messages"] == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "checking", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "weather",
                                                           "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "sunny"}, {"role": "user",
                                                                      "content": "thanks"}]


def test_anthropic_whole_answer_with_a_tool_call():
    conv = anthropic.MessagesConverter("m", stream=False)
    conv.feed(json.dumps({"choices": [{"finish_reason": "tool_calls", "message": {"content": "ok",
                                                                                  "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather",
                                                      "arguments": '{"city":"Paris"}'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2}}).encode())
    out = json.loads(conv.end())
    assert out["type"] == "message" and out["stop_reason"] == "tool_use"
    assert out["content"] == [{"type": "text", "text": "ok"},
                              {"type": "tool_use", "id": "c1", "name": "weather",
                               "input": {"city": "Paris"}}]
    assert out["usage"] == {"input_tokens": 5, "output_tokens": 2}


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_anthropic_stream_event_sequence():
    conv = anthropic.MessagesConverter("m", stream=True)
    evs = events(feed_in_pieces(conv, sse(chunk("Hi"), chunk(" there"), *TOOL_STREAM), 9))
    names = [e for e, _ in evs]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert evs[6][1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "weather",
                                          "input": {}}
    assert "".join(d["delta"]["partial_json"] for e, d in evs
                   if d.get("delta", {}).get("type") == "input_json_delta") \
        == '{"city": "Paris"}'
    assert evs[
        -2][1]["delta"]["stop_reason"] == "tool_use" and evs[-2][1]["usage"]["output_tokens"] == 3


def _stop_chunk(**extra):
    c = chunk(finish="stop")
    c["choices"][0].update(extra)
    return c


@pytest.mark.parametrize("named", [{"stop_reason": "END"}, {"stopping_word": "END"},
                                   {"stop_word": "END"}])
def test_anthropic_stop_sequence_the_engine_names(named):
    """vLLM (and the sim) name the sequence in the choice's stop_reason, llama.cpp's server
    in stopping_word / stop_word: whole and streamed it becomes stop_sequence."""
    whole = anthropic.MessagesConverter("m", stream=False, stops=["STOP", "END"])
    whole.feed(json.dumps({"choices": [{"finish_reason": "stop", "message": {"content": "a b"},
                                        **named}]}).encode())
    out = json.loads(whole.end())
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "END"
    conv = anthropic.MessagesConverter("m", stream=True, stops=["STOP", "END"])
    evs = events(feed_in_pieces(conv, sse(chunk("a b"), _stop_chunk(**named), USAGE), 7))
    assert evs[0][1]["message"]["stop_sequence"] is None
    assert evs[-2][0] == "message_delta" and evs[-2][1]["delta"] == {
        "stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize("stops,named,finish", [
    (["END"], {}, "stop"),  # the engine names none: no guess (EOS looks the same)
    (["END"], {"stop_reason": "OTHER"}, "stop"),  # not one the request gave
    ([], {"stop_reason": "END"}, "stop"),  # the request gave none
    (["END"], {"stop_reason": 128001}, "stop"),  # vLLM's stop token id: not a sequence
    (["END"], {"stop_reason": "END"}, "length"),  # the limit ended it, whatever is said
])
def test_anthropic_stop_sequence_only_when_named_and_asked(stops, named, finish):
    want = "max_tokens" if finish == "length" else "end_turn"
    whole = anthropic.MessagesConverter("m", stream=False, stops=stops)
    whole.feed(json.dumps({"choices": [{"finish_reason": finish, "message": {"content": "a"},
                                        **named}]}).encode())
    out = json.loads(whole.end())
    assert (out["stop_reason"], out["stop_sequence"]) == (want, None)
    conv = anthropic.MessagesConverter("m", stream=True, stops=stops)
    c = chunk(finish=finish)
    c["choices"][0].update(named)
    evs = events(conv.feed(sse(chunk("a"), c)) + conv.end())
    assert evs[-2][1]["delta"] == {"stop_reason": want, "stop_sequence": None}


def test_anthropic_stop_sequences_reach_the_converter_not_the_engine():
    prep = prepare("/v1/messages", "anthropic", b"", "m", "m",
                   {"model": "m", "max_tokens": 5, "stop_sequences": ["END", "STOP"],
                    "messages": [{"role": "user", "content": "hi"}]})
    plan = prep.for_engine("llamacpp")
    assert "stop" not in json.loads(plan.body)  # the hub matches them (translate/stops.py)
    conv = plan.converter(200)
    conv = getattr(conv, "inner", conv)  # one answer: behind the assembler of the stream
    assert isinstance(conv, anthropic.MessagesConverter) and conv.stops == ["END", "STOP"]


# --- OpenAI Responses --------------------------------------------------------------------


def test_responses_request_items_and_function_tools():
    body = {"model": "m", "instructions": "sys", "max_output_tokens": 20,
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
                      {"type": "function_call", "call_id": "c1", "name": "weather",
                       "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    req, stream, _ = responses.request(body, "m")
    assert req["max_tokens"] == 20 and req["tools"][0]["function"]["name"] == "weather"
    assert req["messages"][:2] == [{"role": "system", "content": "sys"}, {"role": "user",
                                                                          "content": "weather?"}]
    assert req["messages"][2]["tool_calls"][0]["id"] == "c1"
    assert req["messages"][3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    with pytest.raises(ApiError) as ei:
        responses.request({"model": "m", "input": "x", "previous_response_id": "r"}, "m")
    assert ei.value.param == "previous_response_id"


def test_responses_stream_events_and_completed_response():
    conv = responses.ResponsesConverter("m", stream=True, echo={})
    evs = events(feed_in_pieces(conv, sse(chunk("Hi"), chunk("!"), USAGE), 4))
    names = [e for e, _ in evs]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.completed"]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    done = evs[-1][1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hi!"
    assert done["usage"]["total_tokens"] == 10
    whole = responses.ResponsesConverter("m", stream=False, echo={})
    whole.feed(json.dumps({"choices": [{"message": {"content": "Hi!"}}]}).encode())
    assert json.loads(whole.end())["output"][0]["content"][0]["text"] == "Hi!"


def test_keep_alive_durations():
    import math

    from appliance.hub.translate.ollama import keep_alive_seconds
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds(
        0) == 0 and keep_alive_seconds("0") == 0 and keep_alive_seconds("0s") == 0
    assert keep_alive_seconds(
        300) == 300 and keep_alive_seconds("5m") == 300 and keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("250ms") == 0.25
    assert keep_alive_seconds(-1) == math.inf and keep_alive_seconds(
        "-1") == math.inf and keep_alive_seconds("-1m") == math.inf
    for bad_value in ("soon", "5", "5x", True, [], ""):
        if bad_value == "5":
            assert keep_alive_seconds(bad_value) == 5  # a bare number string is seconds
            continue
        with pytest.raises(ApiError) as ei:
            keep_alive_seconds(bad_value)
        assert ei.value.param == "keep_alive"


@pytest.mark.parametrize("path,api,body,whole", [
    ("/v1/chat/completions", "openai", {"messages": [{"role": "user", "content": "x"}]}, True),
    ("/v1/completions", "openai", {"prompt": "x"}, True),
    ("/v1/chat/completions", "openai", {"messages": [{"role": "user", "content": "x"}],
                                        "stream": True}, False),
    ("/v1/messages", "anthropic", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "x"}]}, True),
    ("/v1/messages", "anthropic", {"max_tokens": 8, "stream": True, "messages": [
        {"role": "user", "content": "x"}]}, False),
    # The hub matches these stop sequences and closes the engine's stream at one: it reads
    # the stream as it comes.
    ("/v1/messages", "anthropic", {"max_tokens": 8, "stop_sequences": ["END"], "messages": [
        {"role": "user", "content": "x"}]}, False),
    ("/v1/responses", "openai", {"input": "x"}, True),
    ("/v1/responses", "openai", {"input": "x", "stream": True}, False),
    ("/v1/embeddings", "openai", {"input": "x"}, False),
])
def test_a_plan_says_whole_where_the_hub_only_assembles_the_engines_stream(path, api, body,
                                                                           whole):
    data = json.dumps({"model": "m", **body}).encode()
    for kind in ("sim", "llamacpp", "ollama", "openai"):
        plan = prepare(path, api, data, "m", "m").for_engine(kind)
        assert plan.whole is whole
        if whole:  # the engine is asked to stream: a client that leaves still stops it
            assert json.loads(plan.body)["stream"] is True


def test_one_plan_per_request_and_for_engine_picks_it_or_its_translation():
    plan = prepare("/api/chat", "ollama", _chat("hi"), "m", "m")
    assert plan.for_engine("ollama") is plan and plan.for_engine("sim") is plan
    chat = plan.for_engine("llamacpp")
    assert chat is plan.translated and chat.path == "/v1/chat/completions"
    assert plan.for_engine("openai") is chat  # the same value on every attempt
    openai = prepare("/v1/chat/completions", "openai",
                     b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}',
                     "m", "m")
    assert openai.for_engine("llamacpp") is openai and openai.drop_usage
