"""Issue 30 item 6: the drain bounds the exit even when the streams in flight have all left
the hub's hands for the socket buffers and their clients never read them -- plain, TLS and
with hub workers -- and those streams are audited as the drain's cut (`shutting_down`),
not as clean answers nor as lost workers."""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest

from tests.e2e.test_reliability_e2e import _addr, held, pki, start  # noqa: F401  (pki: fixture)
from tests.harness.fleet import Fleet
from tests.harness.pki import client_ctx
from tests.harness.procs import procs, wait_until  # noqa: F401  (procs: the fixture)

pytestmark = pytest.mark.e2e

DRAIN_S = 2


def never_reading_client(f: Fleet, rid: str) -> socket.socket:
    """A client that asks for a short stream (~60 KB: it all fits in the socket buffers,
    so no write of the hub ever waits) and never reads a byte of it (a 2 KiB receive
    buffer: the bytes stay unsent in the hub's socket)."""
    host, port = _addr(f.hub.url)
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    raw.connect((host, port))
    s = (client_ctx(f.tls["ca"], f.tls["hub"]).wrap_socket(raw, server_hostname="127.0.0.1")
         if f.tls else raw)
    data = json.dumps({"model": "sim-small", "stream": True, "max_tokens": 400,
                       "messages": [{"role": "user", "content": f"a short one {rid}"}]}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nx-request-id: %b\r\nContent-Length: %d\r\n\r\n%b"
              % (rid.encode(), len(data), data))
    return s


@pytest.mark.parametrize("kind", ["plain", "tls", "workers"])
def test_sigterm_ends_streams_the_buffers_hold_for_clients_that_never_read_within_the_drain(
        procs, pki, tmp_path, kind):  # noqa: F811
    # The write stall is long (30 s, the default): only the drain may end these waits.
    audit = tmp_path / "audit.jsonl"
    env = {"Hub__DrainSeconds": str(DRAIN_S), "Audit__Path": str(audit)}
    if kind == "workers":
        env["Hub__Workers"] = "2"
    f = start(procs, pki, kind == "tls", env, {"Sim__TokensPerSecond": "200"})  # ~2 s each
    socks = [never_reading_client(f, f"never-read-{i}") for i in range(4)]
    try:
        wait_until(lambda: held(f) == 4, timeout=20, what="4 streams on the node")
        # The node finished them: the hub wrote them whole and waits for them to leave.
        wait_until(lambda: held(f) == 0, timeout=30, what="the node's streams done")
        time.sleep(0.5)
        t0 = time.monotonic()
        f.hub.signal(signal.SIGTERM)
        code = f.hub.wait_exit(DRAIN_S + 40)
        took = time.monotonic() - t0
        # The drain, the listener's 2 s to end cut streams, a worker's exit; the stall
        # (30 s) is far past it.
        assert code == 0 and took < DRAIN_S + 2 + 10, f"the hub took {took:.1f} s to exit"
        lines = [json.loads(x) for x in audit.read_text().splitlines() if "never-read" in x]
        assert sorted(x["request_id"] for x in lines) == [f"never-read-{i}" for i in range(4)]
        assert {(x["status"], x.get("error")) for x in lines} == {(200, "shutting_down")}, [
            json.dumps(x) for x in lines]
    finally:
        for s in socks:
            s.close()
