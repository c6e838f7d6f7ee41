"""The `llamacpp` engine with real llama.cpp servers and a real GGUF.

Each test runs on each real server (tests/conftest.py's `real_server`): llama.cpp's own
`llama-server` (built once by `make llama-server`, run by `make test`) and llama-cpp-python's
`python -m llama_cpp.server` (`make llamacpp-wheel`); one that is not built is skipped. The
model is tests/harness/make_gguf.py's tiny llama (random weights, gibberish at thousands of tokens
per second); its `kev` copy is refused by llama.cpp with its own error line, which must come
out as the model's last error.
"""

from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest
import trio

from appliance import config
from appliance.node.engines.base import EngineError
from appliance.node.engines.llamacpp import LlamaCppEngine
from tests.harness import make_gguf
from tests.harness.fleet import Fleet
from tests.harness.llama_cache import VERSION, RealServer
from tests.node.engines.test_llamacpp_engine import alive, engine_of_a_killed_node, wait_gone

pytestmark = pytest.mark.llamacpp

KEV_LINE = "unknown model architecture: 'kev'"


def assert_version(server: RealServer, version: str) -> None:
    """The engine's install probe: llama-cpp-python's package version, or llama-server's
    `--version` (`version: 0.5.0-dev (build 1, commit 0c1e570)` for 0.3.36's vendored one)."""
    if server.name == "llama_cpp.server":
        assert version == VERSION
    else:
        assert re.match(r"\d+\.\d+", version), version


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    return make_gguf.write_pair(tmp_path_factory.mktemp("gguf"), seed=7)


def make_engine(server: RealServer) -> LlamaCppEngine:
    return LlamaCppEngine(config.load({"Engine__Kind": "llamacpp",
                                       "Engine__Command": server.command}))


async def test_real_load_chat_stream_unload(nursery, gguf_pair, real_server):
    tiny, _ = gguf_pair
    eng = make_engine(real_server)
    await nursery.start(eng.run)
    assert_version(real_server, eng.installs()[0].version)
    t0 = time.monotonic()
    with trio.fail_after(60):
        await eng.load("tiny", str(tiny))
    cold = time.monotonic() - t0
    print(f"\n{real_server.name}: cold start to ready {cold:.2f} s")
    (m,) = eng.models()
    assert (m.state, m.size_mb) == ("ready", 1)
    client = openai.OpenAI(base_url=eng.upstream("tiny") + "/v1", api_key="none", timeout=30,
                           max_retries=0)

    def chat() -> tuple[str, float, int, float]:
        t = time.monotonic()
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                    "content": "hi"}],
                                           max_tokens=16, seed=1)
        full = time.monotonic() - t
        t = time.monotonic()
        first = None
        pieces = []
        for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                             "content": "hi"}],
                                                    max_tokens=32, stream=True, seed=1):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - t
                pieces.append(chunk.choices[0].delta.content)
        return r.choices[0].message.content or "", full, len(pieces), first or 0.0

    text, full, n_chunks, ttft = await trio.to_thread.run_sync(chat)
    print(
        f"{real_server.name}: chat 16 tokens {full * 1000:.0f} ms; stream {n_chunks} chunks, first "
        f"token {ttft * 1000:.0f} ms")
    assert text
    assert n_chunks >= 2
    pid = eng.pid("tiny")
    with trio.fail_after(15):
        await eng.unload("tiny")
    assert not alive(pid)


async def test_real_kev_fails_with_llamacpp_error(nursery, gguf_pair, real_server):
    _, kev = gguf_pair
    eng = make_engine(real_server)
    await nursery.start(eng.run)
    t0 = time.monotonic()
    with trio.fail_after(60), pytest.raises(EngineError) as err:
        await eng.load("kev", str(kev))
    print(f"\n{real_server.name}: kev refused in {time.monotonic() - t0:.2f} s: {err.value}")
    assert KEV_LINE in str(err.value)
    (m,) = eng.models()
    assert m.state == "failed" and KEV_LINE in m.last_error and "Traceback" not in m.last_error


def test_real_sigkill_of_the_node_leaves_no_llama_server(gguf_pair, real_server):
    tiny, _ = gguf_pair

    def the_real_server(pid: int) -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return real_server.marker in f.read()

    child = engine_of_a_killed_node(real_server.command, str(tiny), 60, the_real_server)
    assert wait_gone(child), f"{real_server.name} pid {child} outlived its node"


def engine_children(node_pid: int, marker: bytes) -> list[int]:
    """pids of the engine processes (`marker` in their command line) whose parent is
    `node_pid`."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == node_pid and marker in cmd:
            found.append(int(d))
    return found


@pytest.mark.e2e
def test_real_node_process_loads_serves_refuses_kev_and_dies_clean(procs, gguf_pair, real_server):
    """`appliance node` with Engine__Kind=llamacpp, as an operator runs it."""
    tiny, kev = gguf_pair
    token = "llama-node-secret"
    node = Fleet(procs=procs, token=token).start_node("llama-e2e", {
        "Engine__Kind": "llamacpp", "Engine__Command": real_server.command,
        "Engine__StartTimeoutSeconds": "60"}, announce=False)
    with httpx.Client(base_url=node.url, headers={"authorization": f"Bearer {token}"},
                      timeout=60) as c:
        (engine,) = c.get("/node/v1/state").json()["engines"]
        assert engine["kind"] == "llamacpp"
        assert_version(real_server, engine["version"])
        t0 = time.monotonic()
        r = c.post("/node/v1/models/tiny/load", json={"source": str(tiny)})
        assert r.status_code == 200, r.text
        print(f"\n{real_server.name}: node load of a cold model {time.monotonic() - t0:.2f} s")
        r = c.post("/node/v1/models/kev/load", json={"source": str(kev)})
        assert r.status_code == 502 and KEV_LINE in r.text, r.text
        models = {m["name"]: m for m in c.get("/node/v1/state").json()["models"]}
        assert models["tiny"]["state"] == "ready"
        assert models["kev"]["state"] == "failed" and KEV_LINE in models["kev"]["last_error"]
    client = openai.OpenAI(base_url=node.url + "/v1", api_key=token, timeout=30, max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8)
    assert r.choices[0].message.content
    chunks = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16, stream=True)
              if c.choices]
    assert len([c for c in chunks if c]) >= 2
    (child,) = engine_children(node.pid, real_server.marker)
    node.signal(signal.SIGKILL)
    node.wait_exit(10)
    assert wait_gone(child), f"{real_server.name} pid {child} outlived its node"
