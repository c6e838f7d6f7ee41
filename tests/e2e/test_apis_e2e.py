"""End to end: every client API on every engine kind, through a real hub.

One fleet for the module: a hub, a node with the sim engine (speaks Ollama and OpenAI
natively: bytes pass through) and a node with `Engine__Kind=openai` in front of a
standalone `appliance sim` (the hub translates Ollama, Anthropic and Responses requests
onto its chat completions). The official `ollama`, `openai` and `anthropic` clients run
against a model on each: streamed text equals non-streamed, tool calls round-trip, and
errors arrive as each SDK's own exception type with the hub's message.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
ADMIN = "admin-key"
# One model per engine kind: `s-*` on the sim node (native), `o-*` behind the openai node.
CHAT_MODELS = ["s-chat", "o-chat"]
WEATHER = {"type": "function", "function": {"name": "weather",
                                            "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {
                                                               "city": {"type": "string"}},
                                                           "required": ["city"]}}}
USER = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("apis"), token=TOKEN, admin=ADMIN)
    try:
        f.start_hub({"Audit__Path": f.audit_path, "Router__ActivationWaitSeconds": "20",
                     "Hub__CorsOrigins": "http://app.example, http://other.example"},
                    metrics=False)
        common = {"Node__AnnounceSeconds": "1"}
        f.start_node("sim-n", {**common, "Sim__Models__0__Name": "s-chat",
                               "Sim__Models__1__Name": "s-embed:latest",
                               "Sim__Models__2__Name": "s-keep"})
        sim = f.start_sim({"Sim__Models__0__Name": "o-chat", "Sim__Models__1__Name": "o-embed"})
        f.start_node("oai-n", {**common, "Engine__Kind": "openai", "Engine__Url": sim.url,
                               "Engine__PollSeconds": "1"})
        f.wait(lambda: f.up() == {"sim-n", "oai-n"}, "both nodes up")
        f.wait_models("o-chat", "s-chat")
        yield f
    finally:
        f.close()


# --- Ollama ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_ollama_client_chat_and_generate_streamed_equals_whole(fleet, model):
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    whole = ol.chat(model=model, messages=USER, options={"num_predict": 12, "temperature": 0.1})
    parts = list(ol.chat(model=model, messages=USER, options={"num_predict": 12,
                                                              "temperature": 0.1}, stream=True))
    assert whole.message.content and "".join(p.message.content
                                             for p in parts) == whole.message.content
    assert whole.done and parts[-1].done and not any(p.done for p in parts[:-1])
    assert parts[-1].done_reason == whole.done_reason == "length"
    assert parts[-1].eval_count == whole.eval_count == 12 and whole.prompt_eval_count > 0
    assert whole.total_duration > 0
    g = ol.generate(model=model, prompt="why is the sky blue", options={"num_predict": 5})
    gs = list(ol.generate(model=model, prompt="why is the sky blue", options={"num_predict": 5},
                          stream=True))
    assert g.response and "".join(p.response for p in gs) == g.response and gs[-1].done


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_ollama_client_tool_call_round_trip(fleet, model):
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    r = ol.chat(model=model, messages=USER, tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "weather" and call.function.arguments == {"city": "sim"}
    msgs = [*USER, r.message.model_dump(exclude_none=True), {"role": "tool", "content": "sunny",
                                                             "tool_name": "weather"}]
    final = ol.chat(model=model, messages=msgs, tools=[WEATHER])
    assert final.message.content and not final.message.tool_calls
    streamed = list(ol.chat(model=model, messages=USER, tools=[WEATHER], stream=True))
    assert [c.function.name for p in streamed for c in (p.message.tool_calls or [])] == ["weather"]


async def test_ollama_async_client_and_embeddings_with_latest_names(fleet):
    ac = ollama.AsyncClient(host=fleet.hub.url, timeout=30)
    for model in CHAT_MODELS:
        r = await ac.chat(model=model, messages=USER)
        assert r.message.content
    for model in ("o-embed", "s-embed", "s-embed:latest", "o-embed:latest"):
        e = await ac.embed(model=model, input=["a", "b"])
        assert len(e.embeddings) == 2 and len(e.embeddings[0]) > 0
        legacy = await ac.embeddings(model=model, prompt="a")
        assert legacy.embedding == pytest.approx(e.embeddings[0])
    await trio.sleep(0)


def test_ollama_client_think_on_an_openai_engine(fleet):
    """`think` becomes the engine's switch; its reasoning_content comes back as thinking."""
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    plain = ol.chat(model="o-chat", messages=USER, options={"num_predict": 6})
    r = ol.chat(model="o-chat", messages=USER, options={"num_predict": 6}, think=True)
    assert r.message.thinking and r.message.content == plain.message.content
    assert plain.message.thinking is None
    parts = list(ol.chat(model="o-chat", messages=USER, options={"num_predict": 6}, think=True,
                         stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert "".join(p.message.content for p in parts) == r.message.content
    g = ol.generate(model="o-chat", prompt="why", options={"num_predict": 3}, think="high")
    assert g.thinking and g.response


def test_ollama_errors_are_response_errors_with_the_hub_message(fleet):
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="nope", messages=USER)
    assert ei.value.status_code == 404 and "nope" in ei.value.error
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="o-chat", messages=USER, options={"temperature": "hot"})
    assert ei.value.status_code == 400 and "options.temperature" in ei.value.error


# --- Anthropic ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_anthropic_client_messages_stream_and_tools(fleet, model):
    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0, timeout=30)
    m = ac.messages.create(model=model, max_tokens=10, system="be brief", messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert m.content[0].text and m.usage.output_tokens == 10
    with ac.messages.stream(model=model, max_tokens=10, system="be brief", messages=USER) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens"

    tool = {"name": "weather", "description": "the weather",
            "input_schema": WEATHER["function"]["parameters"]}
    t = ac.messages.create(model=model, max_tokens=50, messages=USER, tools=[tool])
    (use,) = [b for b in t.content if b.type == "tool_use"]
    assert t.stop_reason == "tool_use" and use.name == "weather" and use.input == {"city": "sim"}
    with ac.messages.stream(model=model, max_tokens=50, messages=USER, tools=[tool]) as s:
        streamed = s.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [{"city": "sim"}]
    back = ac.messages.create(model=model, max_tokens=20, tools=[tool], messages=[
        *USER, {"role": "assistant", "content": [b.model_dump() for b in t.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "sunny"}]}])
    assert back.content[0].type == "text" and back.content[0].text


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_anthropic_client_stop_sequences_say_which_one_matched(fleet, model):
    ac = anthropic.Anthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0, timeout=30)
    full = ac.messages.create(model=model, max_tokens=12, messages=USER).content[0].text
    stop = full.split()[6]  # the sim's words are deterministic for one conversation
    m = ac.messages.create(model=model, max_tokens=12, messages=USER,
                           stop_sequences=["never said", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[:full.find(stop)]  # the engine strips the sequence
    with ac.messages.stream(model=model, max_tokens=12, messages=USER,
                            stop_sequences=["never said", stop]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    plain = ac.messages.create(model=model, max_tokens=12, messages=USER, stop_sequences=["zzz"])
    assert plain.stop_reason == "max_tokens" and plain.stop_sequence is None


async def test_anthropic_async_client_and_errors(fleet):
    ac = anthropic.AsyncAnthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0,
                                  timeout=30)
    m = await ac.messages.create(model="o-chat", max_tokens=5, messages=USER)
    assert m.content[0].text
    for model in CHAT_MODELS:  # counted by the engine: the prompt tokens of a one-token answer
        counted = await ac.messages.count_tokens(model=model, messages=USER)
        whole = await ac.messages.create(model=model, max_tokens=5, messages=USER)
        # Anthropic's input_tokens leave out the prompt read from the engine's cache.
        cached = whole.usage.cache_read_input_tokens or 0
        assert counted.input_tokens == whole.usage.input_tokens + cached > 0
    with pytest.raises(anthropic.NotFoundError) as ei:
        await ac.messages.create(model="nope", max_tokens=5, messages=USER)
    assert "nope" in str(ei.value)
    with pytest.raises(anthropic.BadRequestError) as ei:
        await ac.messages.create(model="o-chat", max_tokens=5, messages=[{"role": "wizard",
                                                                          "content": "x"}])
    assert "role" in str(ei.value)


# --- OpenAI ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_openai_responses_stream_equals_whole_and_function_tools(fleet, model):
    oc = openai.OpenAI(base_url=fleet.hub.url + "/v1", api_key="anyone", max_retries=0, timeout=30)
    r = oc.responses.create(model=model, instructions="be brief", input="hello",
                            max_output_tokens=9)
    # The cap cut the answer: incomplete, as OpenAI says it (the stream ends with
    # response.incomplete).
    assert r.output_text and r.status == "incomplete" and r.usage.output_tokens == 9
    assert r.incomplete_details.reason == "max_output_tokens"
    deltas, done = [], None
    for ev in oc.responses.create(model=model, instructions="be brief", input="hello",
                                  max_output_tokens=9, stream=True):
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type in ("response.completed", "response.incomplete"):
            done = ev.response
    assert "".join(deltas) == r.output_text == done.output_text
    assert done.status == "incomplete" and done.usage.output_tokens == 9
    assert r.id != done.id and r.id.startswith("resp_")

    tool = {"type": "function", **WEATHER["function"]}
    t = oc.responses.create(model=model, input=USER, tools=[tool])
    (call,) = [o for o in t.output if o.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments) == {"city": "sim"}
    back = oc.responses.create(model=model, tools=[tool], input=[
        *USER, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert back.output_text
    with oc.responses.stream(model=model, input=USER, tools=[tool]) as s:
        final = s.get_final_response()
    assert [o.name for o in final.output if o.type == "function_call"] == ["weather"]


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_openai_chat_tools_and_bad_bodies(fleet, model):
    oc = openai.OpenAI(base_url=fleet.hub.url + "/v1", api_key="anyone", max_retries=0, timeout=30)
    r = oc.chat.completions.create(model=model, messages=USER, tools=[WEATHER])
    assert r.choices[0].message.tool_calls[0].function.name == "weather"
    with pytest.raises(openai.BadRequestError) as ei:
        oc.chat.completions.create(model=model, messages=USER, temperature="hot")
    assert ei.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as ei:
        oc.chat.completions.create(model=model, messages="x")
    assert ei.value.body["param"] == "messages"


def test_request_id_is_taken_or_made_returned_and_audited(fleet):
    body = {"model": "o-chat", "messages": USER, "max_tokens": 2}
    r = httpx.post(fleet.hub.url + "/v1/chat/completions", json=body,
                   headers={"x-request-id": "trace-42"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    made = httpx.post(fleet.hub.url + "/api/chat", json={"model": "s-chat", "messages": USER,
                                                         "stream": False}, timeout=30)
    rid = made.headers["x-request-id"]
    assert len(rid) == 32 and rid != "trace-42"
    bad = httpx.post(fleet.hub.url + "/v1/messages", json={"model": "o-chat", "messages": USER},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["type"] == "error" and bad.headers["x-request-id"]

    def audited():
        lines = [json.loads(x) for x in open(fleet.audit_path).read().splitlines()]
        return {x.get("request_id") for x in lines if x["kind"] == "request"}
    wait_until(lambda: {"trace-42", rid} <= audited(), what="request ids in the audit")


def test_liveness_version_one_model_show_and_unsupported_routes(fleet):
    url = fleet.hub.url
    r = httpx.get(url + "/", timeout=10)
    assert r.status_code == 200 and r.text == "Ollama is running" and len(
        r.headers["x-request-id"]) == 32
    assert httpx.get(url + "/api/tags", headers={"x-request-id": "t-1"},
                     timeout=10).headers["x-request-id"] == "t-1"
    assert httpx.head(url + "/", timeout=10).status_code == 200
    browser = httpx.get(url + "/", headers={"accept": "text/html,application/xhtml+xml"},
                        timeout=10)
    assert browser.status_code == 302 and browser.headers["location"] == "/ui/"
    v = httpx.get(url + "/api/version", timeout=10).json()
    assert v["version"].count(".") == 2 and v["appliance_version"]

    oc = openai.OpenAI(base_url=url + "/v1", api_key="anyone", max_retries=0, timeout=30)
    assert oc.models.retrieve("o-chat").id == "o-chat"
    assert oc.models.retrieve("s-embed").id == "s-embed:latest"
    with pytest.raises(openai.NotFoundError):
        oc.models.retrieve("nope")

    ol = ollama.Client(host=url, timeout=30)
    native = ol.show("s-chat")  # the sim node answers it as Ollama would
    assert native.details.family == "sim" and native.modelinfo["sim.context_length"] > 0
    synth = ol.show("o-chat")  # an openai engine: what the hub knows
    assert synth.modelinfo[
        "general.architecture"] == "openai" and "completion" in synth.capabilities
    with pytest.raises(ollama.ResponseError) as ei:
        ol.show("nope")
    assert ei.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as ei:
        ol.copy("o-chat", "o-copy")
    assert ei.value.status_code == 501 and "engine" in ei.value.error


def test_cors_preflight_and_headers_for_allowed_origins_only(fleet):
    url = fleet.hub.url
    pre = httpx.options(url + "/v1/chat/completions", timeout=10, headers={
        "origin": "http://app.example", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.headers[
        "access-control-allow-origin"] == "http://app.example"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.post(url + "/api/chat", timeout=30, headers={"origin": "http://other.example"},
                   json={"model": "o-chat", "messages": USER, "stream": False})
    assert r.status_code == 200 and r.headers[
        "access-control-allow-origin"] == "http://other.example"
    foreign = httpx.get(url + "/api/tags", headers={"origin": "http://evil.example"}, timeout=10)
    assert foreign.status_code == 200 and "access-control-allow-origin" not in foreign.headers
    denied = httpx.options(url + "/api/chat", timeout=10, headers={
        "origin": "http://evil.example", "access-control-request-method": "POST"})
    assert denied.status_code == 403 and "access-control-allow-origin" not in denied.headers


def model_status(fleet, name: str) -> dict:
    return next(m for m in fleet.status()["models"] if m["name"] == name)


def test_tags_and_ps_carry_the_engines_metadata(fleet):
    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    ol.chat(model="s-chat", messages=USER)
    tags = {m.model: m for m in ol.list().models}
    assert tags["s-chat"].details.family == "sim" and tags["s-chat"].digest
    assert tags["s-chat"].modified_at.year >= 2024
    wait_until(lambda: any(m.model == "s-chat" and m.context_length for m in ol.ps().models),
               what="ps context length")
    ps = {m.model: m for m in ol.ps().models}
    assert ps["s-chat"].details.family == "sim" and ps["s-chat"].expires_at.year >= 2024


def test_keep_alive_is_honoured_across_the_fleet(fleet):
    import datetime

    ol = ollama.Client(host=fleet.hub.url, timeout=30)
    ol.chat(model="s-keep", messages=USER, keep_alive=-1)
    ps = {m.model: m for m in ol.ps().models}
    assert ps["s-keep"].expires_at.year > 2200  # until unloaded
    ol.chat(model="s-keep", messages=USER, keep_alive="5m")
    left = next(m for m in ol.ps().models
                if m.model == "s-keep").expires_at - datetime.datetime.now(datetime.UTC)
    assert datetime.timedelta(minutes=4) < left <= datetime.timedelta(minutes=5, seconds=5)
    g = ol.generate(model="s-keep", keep_alive=0)  # Ollama's unload request
    assert g.done and g.done_reason == "unload"
    wait_until(lambda: model_status(fleet, "s-keep")["ready"] == 0, what="s-keep unloaded")
    # Not wanted any more: the hub does not load it again by itself.
    assert model_status(fleet, "s-keep")["desired"] == 0
    assert "s-keep" not in {m.model for m in ol.ps().models}
    r = ol.chat(model="s-keep", messages=USER, keep_alive=0)  # used once, then unloaded again
    assert r.message.content
    wait_until(lambda: model_status(fleet, "s-keep")["ready"] == 0,
               what="s-keep unloaded after its request")
    with pytest.raises(ollama.ResponseError) as ei:
        ol.chat(model="s-keep", messages=USER, keep_alive="soon")
    assert ei.value.status_code == 400 and "keep_alive" in ei.value.error


@pytest.mark.parametrize("model", CHAT_MODELS)
def test_langchain_chat_models_and_embeddings(fleet, model):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_ollama import ChatOllama, OllamaEmbeddings
    from langchain_openai import ChatOpenAI

    for chat in (ChatOllama(model=model, base_url=fleet.hub.url, num_predict=8),
                 ChatOpenAI(model=model, base_url=fleet.hub.url + "/v1", api_key="anyone",
                            max_tokens=8, max_retries=0)):
        whole = chat.invoke("hello")
        streamed = "".join(c.content for c in chat.stream("hello"))
        assert whole.content and streamed == whole.content
        with_tools = chat.bind_tools([WEATHER])
        ask = with_tools.invoke([HumanMessage("weather in Paris?")])
        (call,) = ask.tool_calls
        assert call["name"] == "weather" and call["args"] == {"city": "sim"}
        back = with_tools.invoke([HumanMessage("weather in Paris?"), ask,
                                  ToolMessage("sunny", tool_call_id=call["id"] or "call_0")])
        assert back.content and not back.tool_calls
    emb = OllamaEmbeddings(model=model.replace("chat", "embed"), base_url=fleet.hub.url)
    vecs = emb.embed_documents(["a", "b"])
    assert len(vecs) == 2 and vecs[0] == pytest.approx(emb.embed_query("a"))


def test_pull_and_delete_across_the_fleet_with_the_admin_key(fleet):
    import io

    from appliance import ctl

    admin = ollama.Client(host=fleet.hub.url, timeout=30,
                          headers={"authorization": f"Bearer {ADMIN}"})
    with pytest.raises(ollama.ResponseError) as ei:
        ollama.Client(host=fleet.hub.url, timeout=30).pull("s-new")
    assert ei.value.status_code == 401
    progress = list(admin.pull("s-new", stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.completed == p.total and p.total for p in progress)
    wait_until(lambda: "s-new" in {m["name"] for m in fleet.status()["models"]},
               what="pulled model in the catalog")
    assert ollama.Client(host=fleet.hub.url, timeout=30).chat(model="s-new",
                                                              messages=USER).message.content

    out, err = io.StringIO(), io.StringIO()
    argv = ["--url", fleet.hub.url, "--key", ADMIN]
    assert ctl.run([*argv, "pull", "s-other", "--node", "sim-n"], out=out, err=err) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "sim-n: pulling manifest" and "100% of 500 MiB" in out.getvalue() and lines[
        -1] == "success"
    # An openai engine cannot pull: said so, in Ollama's shape, and ctl exits 1.
    assert ctl.run([*argv, "pull", "s-other", "--node", "oai-n"], out=io.StringIO(), err=err) == 1
    assert "501" in err.getvalue() and "oai-n" in err.getvalue()
    out = io.StringIO()
    assert ctl.run([*argv, "rm", "s-other"], out=out, err=err) == 0 and "sim-n" in out.getvalue()
    admin.delete("s-new")
    with pytest.raises(ollama.ResponseError) as ei:
        admin.delete("s-new")
    assert ei.value.status_code == 404
    wait_until(lambda: not {"s-new", "s-other"} & {m["name"] for m in fleet.status()["models"]},
               what="deleted models leave the catalog")
