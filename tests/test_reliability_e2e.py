"""Issue 22 against real processes: what a hostile client or box can no longer do.

Each case starts what it needs (OS-chosen ports), acts as the attacker would, and checks
that ordinary service goes on.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from procs import procs  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e

TOKEN = "shared-node-token"


def _addr(url: str) -> tuple[str, int]:
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def test_token_less_announce_heads_are_refused_before_their_body(procs):  # noqa: F811
    # 70 heads that promise a body and never send it, with no token, on a hub that takes
    # 64 connections: each is refused from its head (401 at once), so none holds a
    # connection for the body deadline and /health stays quick.
    hub = procs.hub({"Auth__NodeToken": TOKEN, "Hub__MaxConnections": "64",
                     "Hub__BodyReadSeconds": "30", "Hub__HeaderReadSeconds": "30"})
    host, port = _addr(hub.url)
    socks = []
    try:
        for _ in range(70):
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(b"POST /api/nodes/announce HTTP/1.1\r\nHost: hub\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n")
            socks.append(s)
        answers = []
        for s in socks[:8]:
            answers.append(s.recv(4096))
        assert all(a.startswith(b"HTTP/1.1 401") for a in answers), answers
        assert all(b"invalid_node_token" in a for a in answers), answers
        t0 = time.monotonic()
        r = httpx.get(hub.url + "/health", timeout=10)
        took = time.monotonic() - t0
        assert r.status_code == 200
        assert took < 1.0, f"/health took {took:.2f} s behind 70 token-less announce heads"
        # A wrong token is refused the same way (from the head).
        r = httpx.post(hub.url + "/api/nodes/announce", headers={"authorization": "Bearer nope"},
                       json={"name": "n", "url": "http://127.0.0.1:1"}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_node_token"
    finally:
        for s in socks:
            s.close()
