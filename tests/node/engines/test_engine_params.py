"""Parameters fitted to the engine (node/engines/params.py): `max_completion_tokens` as
`max_tokens` where the engine takes only that, `json_schema` as llama-cpp-python's
`json_object` + `schema`; the node applies it before forwarding, and the llamacpp adapter
knows which server it started."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import httpx
import trio

from appliance import config
from appliance.node.engines.llamacpp import LlamaCppEngine
from appliance.node.engines.params import LLAMA_CPP_PYTHON, OLLAMA, OPENAI, fit
from tests.harness import HARNESS
from tests.node.test_node_app import running_node

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CHAT = "/v1/chat/completions"


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       **fields}).encode()


def test_openai_engines_get_the_bytes_as_they_are() -> None:
    b = body(max_completion_tokens=5, response_format={
        "type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}})
    assert fit(OPENAI, CHAT, b) is b  # llama-server, vLLM, the sim: OpenAI's names
    plain = body(max_tokens=5)
    assert fit(LLAMA_CPP_PYTHON, CHAT, plain) is plain  # neither field: not even decoded
    assert fit(LLAMA_CPP_PYTHON, "/v1/embeddings", b) is b
    assert fit(LLAMA_CPP_PYTHON, CHAT, b"not json max_completion_tokens") == (
        b"not json max_completion_tokens")


def test_max_completion_tokens_becomes_the_engines_cap() -> None:
    for dialect in (LLAMA_CPP_PYTHON, OLLAMA):
        out = json.loads(fit(dialect, CHAT, body(max_completion_tokens=7)))
        assert out["max_tokens"] == 7 and "max_completion_tokens" not in out
        both = json.loads(fit(dialect, CHAT, body(max_completion_tokens=7, max_tokens=3)))
        assert both["max_tokens"] == 3 and "max_completion_tokens" not in both
    out = json.loads(fit(LLAMA_CPP_PYTHON, "/v1/completions",
                         json.dumps({"model": "m", "prompt": "x",
                                     "max_completion_tokens": 4}).encode()))
    assert out["max_tokens"] == 4


def test_json_schema_becomes_llama_cpp_pythons_json_object_with_schema() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA, "strict": True}}
    out = json.loads(fit(LLAMA_CPP_PYTHON, CHAT, body(response_format=rf)))
    assert out["response_format"] == {"type": "json_object", "schema": SCHEMA}
    bare = json.loads(fit(LLAMA_CPP_PYTHON, CHAT, body(response_format={
        "type": "json_schema", "json_schema": {"name": "o"}})))
    assert bare["response_format"] == {"type": "json_object"}
    # Ollama's OpenAI routes take json_schema as it is.
    assert json.loads(fit(OLLAMA, CHAT, body(response_format=rf)))["response_format"] == rf


async def test_the_node_fits_the_body_to_its_engine_and_sends_json() -> None:
    async with running_node() as n:
        n.engine.dialect = lambda model: LLAMA_CPP_PYTHON  # type: ignore[method-assign]
        rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}
        r = await n.http.post(CHAT, content=json.dumps({
            "model": "sim-small", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 5, "response_format": rf}),
            headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200
        _path, sent, headers = n.upstream.seen[-1]
        got = json.loads(sent)
        assert got["max_tokens"] == 5 and "max_completion_tokens" not in got
        assert got["response_format"] == {"type": "json_object", "schema": SCHEMA}
        assert headers["content-type"] == "application/json"


FAKE = HARNESS / "fake_llama_server.py"
FAKE_CMD = (f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} -m {{model}} "
            "--port {port} {args}")


async def test_llamacpp_adapter_knows_llama_cpp_python_by_its_missing_health(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    eng = LlamaCppEngine(config.load({"Engine__Kind": "llamacpp", "Engine__Command": FAKE_CMD}))
    await nursery.start(eng.run)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 1024)
    with trio.fail_after(20):
        await eng.load("server", str(model), "--health-delay 0")
        await eng.load("python", str(model), "--health-delay 0 --fake-mode python")
    assert (eng.dialect("server"), eng.dialect("python")) == (OPENAI, LLAMA_CPP_PYTHON)
    base = eng.upstream("python")
    assert base is not None
    rf = {"type": "json_schema", "json_schema": {"name": "o", "schema": SCHEMA}}
    req = body(response_format=rf, max_completion_tokens=2)
    async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
        refused = await c.post(base + CHAT, content=req)
        fitted = await c.post(base + CHAT, content=fit(eng.dialect("python"), CHAT, req))
    assert refused.status_code == 422  # what the engine says to the client's own body
    assert fitted.status_code == 200 and fitted.json()["usage"]["completion_tokens"] == 2
    with trio.fail_after(20):
        await eng.unload("server")
        await eng.unload("python")


def test_the_servers_answer_with_the_models_name_not_its_file() -> None:
    from appliance.node.engines.childproc import with_alias

    server = ["/opt/llama/llama-server", "-m", "/models/x.gguf", "--port", "1"]
    assert with_alias(server, "tiny") == [*server, "--alias", "tiny"]
    python = ["/venv/bin/python", "-m", "llama_cpp.server", "--model", "/m/x.gguf"]
    assert with_alias(python, "tiny") == [*python, "--model_alias", "tiny"]
    named = [*server, "--alias=mine"]
    assert with_alias(named, "tiny") == named  # the operator's own alias stands
    wrapper = ["/usr/local/bin/run-llama.sh", "/models/x.gguf"]
    assert with_alias(wrapper, "tiny") == wrapper  # an unknown command is left alone
