"""Issue 22 against real processes: what a hostile client or box can no longer do.

Each case starts what it needs (OS-chosen ports), acts as the attacker would, and checks
that ordinary service goes on.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from procfs import peak_rss_kb
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


def test_decoded_bodies_count_against_the_budget_peak_rss_stays_under_twice_it(procs):  # noqa: F811
    # 8 concurrent 30 MB bodies of a million tiny messages each, on the routes that decode
    # and translate: before, the hub decoded what the byte budget admitted and grew by
    # hundreds of MB per body; now the decoded estimate is held too, so what runs at once
    # stays within the budget and the peak grows by less than twice it.
    budget = 64 * 1024 * 1024
    hub = procs.hub({"Hub__MaxBufferedBytes": str(budget), "Hub__MaxBodyBytes": str(40 << 20)})
    body = json.dumps({"model": "m", "max_tokens": 5, "messages":
                       [{"role": "user", "content": "a"}] * 1_000_000},
                      separators=(",", ":")).encode()
    assert len(body) > 25 << 20
    base = peak_rss_kb(hub.pid)
    statuses: list[int] = []

    def post(path: str) -> None:
        try:
            r = httpx.post(hub.url + path, content=body, timeout=60,
                           headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert r.headers.get("retry-after")
        except httpx.HTTPError as e:  # a refused body may be cut while it is still sent
            statuses.append(type(e).__name__)

    paths = ["/v1/messages", "/v1/chat/completions", "/api/chat", "/v1/responses"] * 2
    threads = [threading.Thread(target=post, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grew = (peak_rss_kb(hub.pid) - base) * 1024
    assert len(statuses) == 8 and 503 in statuses, statuses
    assert grew < 2 * budget, f"peak RSS grew {grew >> 20} MiB for a {budget >> 20} MiB budget"
    # Ordinary requests are still decoded and answered (no such model here: 404).
    r = httpx.post(hub.url + "/v1/chat/completions", timeout=10,
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
