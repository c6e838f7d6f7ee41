"""A llama.cpp server that stops generating (SIGSTOP: its port still accepts, nothing comes
back) behind a real hub and node (`Engine__Kind=llamacpp`: the stand-in server of
tests/harness/fake_llama_server.py, and each real server where it is built): the node's probe times out, the replica is marked
unhealthy (the hub says so and counts it toward parking like a failed start), the node
kills the stopped process and starts it again, and the model serves again."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.harness import make_gguf
from tests.harness.fleet import Fleet
from tests.harness.procs import Procs, wait_until
from tests.node.engines.test_llamacpp_engine import FAKE_CMD, wait_gone

pytestmark = pytest.mark.e2e

TOKEN = "probe-llama-token"
PID_LINE = re.compile(r"llamacpp: pid (\d+) serves tiny")


def test_a_stopped_llama_server_is_restarted_and_counted(procs: Procs, tmp_path):
    model = tmp_path / "tiny.gguf"
    model.write_bytes(b"GGUF not really\n")
    stopped_and_restarted(procs, tmp_path, FAKE_CMD, model)


@pytest.mark.llamacpp
def test_a_stopped_real_server_is_restarted_and_counted(procs: Procs, tmp_path, real_server):
    """The same with llama.cpp's own servers (the cached builds; skipped where absent)."""
    tiny, _ = make_gguf.write_pair(tmp_path, seed=11)
    stopped_and_restarted(procs, tmp_path, real_server.command, tiny)


def stopped_and_restarted(procs: Procs, tmp_path, command: str, model) -> None:
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    node = f.start_node("gpu-a", {"Engine__Kind": "llamacpp", "Engine__Command": command,
                                  "Engine__StartTimeoutSeconds": "60", "Node__ProbeSeconds": "1",
                                  "Node__ProbeTimeoutSeconds": "3"}, announce=False)
    f.start_hub({"Audit__Path": f.audit_path, "Hub__ControlIntervalSeconds": "0.2",
                 "Nodes__0__Name": "gpu-a", "Nodes__0__Url": node.url,
                 "Models__0__Name": "tiny", "Models__0__Source": str(model),
                 "Models__0__Replicas": "1"}, metrics=False)

    def model_status() -> dict:
        return f.models()["tiny"]

    def pids() -> list[int]:
        return [int(m.group(1)) for line in node.stderr_lines if (m := PID_LINE.search(line))]

    wait_until(lambda: model_status()["ready"] == 1 and pids(), 60, "tiny ready")
    first = pids()[-1]
    assert f.chat("tiny", max_tokens=4).status_code == 200

    os.kill(first, signal.SIGSTOP)
    try:
        wait_until(lambda: len(pids()) >= 2, 60, "the engine process started again")
        assert pids()[-1] != first
        assert wait_gone(first), "the stopped process was left behind"
    finally:
        try:
            os.kill(first, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_until(lambda: model_status()["ready"] == 1, 60, "tiny ready again")
    m = model_status()
    assert m["consecutive_start_failures"] >= 1 and "one-token generation" in m["last_error"], m
    assert f.chat("tiny", max_tokens=4).status_code == 200
    events = f.audit()
    assert any(e["kind"] == "replica_unhealthy" and e["node"] == "gpu-a" for e in events)
    assert any("restarting the engine process of tiny" in x for x in node.stderr_lines)
