"""LlamaCppEngine against tests/harness/fake_llama_server.py, a stand-in that acts like llama-server.

These start real (small) processes, so they run in real time; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
import trio

from appliance import config
from appliance.node.engines import llamacpp
from appliance.node.engines.base import EngineError, unheard
from appliance.node.engines.childproc import Child, expand_command
from appliance.node.engines.llamacpp import LlamaCppEngine, pick_error
from tests.harness import HARNESS
from tests.harness.procs import wait_until

FAKE = HARNESS / "fake_llama_server.py"
FAKE_CMD = f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} -m {{model}} --port {{port}} {{args}}"
KEV_LINE = "unknown model architecture: 'kev'"


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for a reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    """The OS takes a moment to reap a killed process: look again until a deadline."""
    try:
        wait_until(lambda: not alive(pid), timeout=seconds, what=f"pid {pid} gone", interval=0.02)
    except AssertionError:
        return False
    return True


def make_engine(command: str = FAKE_CMD, on_change=unheard) -> LlamaCppEngine:
    return LlamaCppEngine(config.load({"Engine__Kind": "llamacpp", "Engine__Command": command}),
                          on_change)


@pytest.fixture
def spawned(monkeypatch) -> list[tuple[int, int]]:
    """Every engine process the engine starts, as (pid, the forking thread's ident): the
    engine's own `Child`, wrapped, so a test sees a pid even after its model is gone."""
    seen: list[tuple[int, int]] = []

    class Recorded(Child):
        def __init__(self, argv: list[str]) -> None:
            super().__init__(argv)
            seen.append((self.pid, threading.get_ident()))

    monkeypatch.setattr(llamacpp, "Child", Recorded)
    return seen


@pytest.fixture
def model_file(tmp_path: Path):
    def make(name: str) -> str:
        p = tmp_path / name
        p.write_bytes(b"GGUF" + b"\0" * (3 * 1024 * 1024))
        return str(p)

    return make


# --- pure parts ------------------------------------------------------------------------


def test_expand_command_splices_args_and_keeps_paths_whole():
    argv = expand_command("llama-server -m {model} --port {port} {args}", "/m/a b.gguf", 4321,
                          "-ngl 99 --ctx-size 8192")
    assert argv == ["llama-server", "-m", "/m/a b.gguf", "--port", "4321", "-ngl", "99",
                    "--ctx-size", "8192"]
    assert expand_command("srv --model={model} {args}", "x", 1, "") == ["srv", "--model=x"]


def test_pick_error_prefers_llama_line_over_traceback():
    tail = textwrap.dedent("""\
        llama_model_loader: - kv   0: general.architecture str = kev
        llama_model_load: error loading model: error loading model architecture: unknown model architecture: 'kev'
        llama_model_load_from_file_impl: failed to load model
        Traceback (most recent call last):
          File "x.py", line 1, in <module>
        ValueError: Failed to load model from file: /m/kev.gguf
        """)
    assert pick_error(tail).endswith(KEV_LINE)


def test_pick_error_falls_back_to_traceback_then_last_lines():
    assert pick_error(
        "starting\nTraceback (most recent call last):\n  File \"a\", line 1\nKeyError: 'x'\n") == "KeyError: 'x'"
    assert pick_error("one\n\ntwo\nthree\nfour\n") == "two | three | four"
    assert pick_error("") == ""


# --- with the stand-in -----------------------------------------------------------------


async def test_load_ready_completion_unload(nursery, model_file):
    changes = []
    eng = make_engine(on_change=lambda: changes.append([(m.name, m.state) for m in eng.models()]))
    await nursery.start(eng.run)
    assert eng.installs()[0].kind == "llamacpp"
    path = model_file("tiny.gguf")
    with trio.fail_after(20):
        await eng.load("tiny", path)
    base = eng.upstream("tiny")
    assert base and base.startswith("http://127.0.0.1:")
    (m,) = eng.models()
    assert (m.name, m.state, m.size_mb) == ("tiny", "ready", 4)
    assert ("tiny", "loading") in changes[0] and changes[-1] == [("tiny", "ready")]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10), trust_env=False) as c:
        r = await c.post(base + "/v1/chat/completions", json={"model": "tiny", "messages": [],
                                                              "max_tokens": 3})
        assert r.json()["choices"][0]["message"]["content"] == "the quick brown"
    pid = eng.pid("tiny")
    assert pid and alive(pid)
    with trio.fail_after(15):
        await eng.load("tiny", path)  # already ready: a no-op
    assert eng.pid("tiny") == pid
    with trio.fail_after(15):
        await eng.unload("tiny")
    assert not alive(pid)
    assert eng.upstream("tiny") is None
    assert [(m.name, m.state) for m in eng.models()] == [("tiny", "available")]


async def test_kev_fails_with_llamacpp_line(nursery, model_file):
    eng = make_engine()
    await nursery.start(eng.run)
    with trio.fail_after(20), pytest.raises(EngineError) as err:
        await eng.load("kev", model_file("tiny-kev.gguf"))
    assert KEV_LINE in str(err.value)
    assert "Traceback" not in str(err.value)
    (m,) = eng.models()
    assert m.state == "failed" and KEV_LINE in m.last_error
    assert eng.upstream("kev") is None


async def test_a_foreign_server_on_the_port_is_not_taken_for_ours(nursery, model_file, tmp_path,
                                                                 monkeypatch):
    """Another process that took the free port before the child bound it answers /health
    200: the engine must not call the model ready on its word (it did: a model served by
    the wrong server, or here a kev file reported loaded) -- ours lists its alias."""
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", 0))
    foreign.listen(16)

    async def answer_all() -> None:
        sock = trio.socket.from_stdlib_socket(foreign)
        while True:
            conn, _ = await sock.accept()
            with conn:
                await conn.recv(65536)
                body = json.dumps({"object": "list", "data": [{"id": "someone-else"}]}).encode()
                await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
                                + body)

    nursery.start_soon(answer_all)
    monkeypatch.setattr(llamacpp, "free_port", lambda: foreign.getsockname()[1])
    wrapper = tmp_path / "llama-server"  # named as the real one: the engine gives it --alias
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} \"$@\"\n")
    wrapper.chmod(0o755)
    eng = make_engine(f"{wrapper} -m {{model}} --port {{port}} {{args}}")
    await nursery.start(eng.run)
    with trio.fail_after(20), pytest.raises(EngineError) as err:
        await eng.load("kev", model_file("tiny-kev.gguf"))
    assert KEV_LINE in str(err.value)
    assert eng.upstream("kev") is None


async def test_missing_file_and_missing_command(nursery, tmp_path):
    eng = make_engine()
    await nursery.start(eng.run)
    with trio.fail_after(20), pytest.raises(EngineError, match="failed to open GGUF file"):
        await eng.load("nofile", str(tmp_path / "nope.gguf"))
    gone = make_engine(f"{tmp_path}/no-such-llama-server -m {{model}} --port {{port}}")
    await nursery.start(gone.run)
    assert gone.installs() == []
    with pytest.raises(EngineError, match="cannot start"):
        await gone.load("x", "x")


async def test_start_timeout_is_the_callers_and_stops_the_process(nursery, model_file,
                                                                  spawned):
    eng = make_engine()
    await nursery.start(eng.run)
    t0 = trio.current_time()
    with trio.move_on_after(1.5) as scope:
        await eng.load("stall", model_file("stall.gguf"))
    assert scope.cancelled_caught
    assert trio.current_time() - t0 < 10  # the stop after the cancel is bounded too
    ((pid, _),) = spawned
    assert not alive(pid)
    (m,) = eng.models()
    assert m.state == "failed" and "start timeout" in m.last_error


async def test_chatty_output_does_not_block_and_tail_is_bounded(nursery, model_file):
    eng = make_engine()
    await nursery.start(eng.run)
    with trio.fail_after(20):
        await eng.load("chatty", model_file("chatty.gguf"))
    assert len(eng._models["chatty"].tail) <= 2 * 64 * 1024


async def test_crash_after_ready_marks_failed(nursery, model_file):
    left_ready = trio.Event()

    def changed() -> None:
        if eng.models() and eng.models()[0].state not in ("loading", "ready"):
            left_ready.set()

    eng = make_engine(on_change=changed)
    await nursery.start(eng.run)
    with trio.fail_after(20):
        await eng.load("crash", model_file("crash.gguf"))
        await left_ready.wait()
    (m,) = eng.models()
    assert m.state == "failed" and "GGML_ASSERT" in m.last_error
    assert eng.upstream("crash") is None


async def test_cancelled_engine_leaves_no_process(model_file):
    eng = make_engine()
    async with trio.open_nursery() as n:
        await n.start(eng.run)
        with trio.fail_after(20):
            await eng.load("a", model_file("a.gguf"))
            await eng.load("b", model_file("b.gguf"), "--health-delay 0")
        pids = [eng.pid("a"), eng.pid("b")]
        assert all(pids) and all(alive(p) for p in pids)
        n.cancel_scope.cancel()
    assert not any(alive(p) for p in pids)


def test_a_child_dies_with_the_thread_that_forked_it(model_file):
    """Why the fork thread matters: the parent-death signal fires when the forking *thread*
    ends, so a child forked from a worker thread dies with that thread."""
    got: list[Child] = []
    t = threading.Thread(target=lambda: got.append(Child(["sleep", "60"])))
    t.start()
    t.join(10)
    (child,) = got
    try:
        assert wait_gone(child.pid), "a child outlived the thread that forked it"
    finally:
        child.signal(signal.SIGKILL)
        child.popen.wait(10)


async def test_process_outlives_trio_worker_threads(nursery, model_file, spawned):
    """The parent-death signal is tied to the forking thread: it must be the trio thread,
    which lives as long as the node, never one of trio's worker threads (they exit when
    idle)."""
    eng = make_engine()
    await nursery.start(eng.run)
    with trio.fail_after(20):
        await eng.load("t", model_file("t.gguf"))
    ((pid, forker),) = spawned
    assert forker == threading.get_ident()  # the trio thread, not a worker
    await trio.to_thread.run_sync(lambda: None)
    assert pid == eng.pid("t") and alive(pid)


PARENT = str(HARNESS / "llama_parent.py")  # a node-like parent process


def engine_of_a_killed_node(command: str, model: str, seconds: float, check=alive) -> int:
    """The engine pid of a node-like parent that loaded `model` with `command` (in `seconds`
    at most) and was then SIGKILLed, once `check(pid)` held."""
    parent = subprocess.Popen([sys.executable, PARENT, command, model], stdout=subprocess.PIPE,
                              text=True)
    try:
        ready, _, _ = select.select([parent.stdout], [], [], seconds)
        assert ready, f"the node-like parent did not load its model in {seconds:g} s"
        child = int(parent.stdout.readline())
        assert check(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        return child
    finally:
        parent.kill()
        parent.wait(10)


def test_sigkill_of_the_node_leaves_no_engine(model_file):
    child = engine_of_a_killed_node(FAKE_CMD, model_file("m.gguf"), 30)
    assert wait_gone(child), f"engine pid {child} outlived its node"
