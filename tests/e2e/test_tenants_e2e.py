"""Per-key limits as the official SDKs see them, on real processes: a 429 is their
RateLimitError, and their built-in retry waits our Retry-After and then succeeds.

A key with `MaxConcurrent=1` and a slow simulated engine: one request holds the key's
only place for about a second; a second request meanwhile is refused with
`Retry-After: 1`. With retries off the SDK raises RateLimitError; with them on it waits
(at least the Retry-After: the SDKs' own first backoff is at most 0.5 s) and succeeds.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
KEY = "team-key"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("tenants")
    f = Fleet(tmp, token=TOKEN, key=KEY)
    try:
        h = f.start_hub({"Audit__Path": f.audit_path,
                         "Auth__Clients__0__Name": "team", "Auth__Clients__0__Key": KEY,
                         "Auth__Clients__0__MaxConcurrent": "1",
                         "Router__ActivationWaitSeconds": "20"}, metrics=False)
        # 20 tokens a second: a 20-token answer holds the key's one place for ~1 s.
        f.start_node("sim-n", {"Node__AnnounceSeconds": "1", "Sim__TokensPerSecond": "20",
                               "Sim__Models__0__Name": "s-chat"})
        f.wait_models("s-chat")
        f.answer("s-chat", "hello", max_tokens=1)  # warm: the first request loads the model
        yield h, Path(f.audit_path)
    finally:
        f.close()


def hold_the_place(url: str) -> threading.Thread:
    """One request of the key that runs ~1 s; returns once the hub counts it in flight."""
    def run() -> None:
        httpx.post(url + "/v1/chat/completions", timeout=30,
                   headers={"authorization": f"Bearer {KEY}"},
                   json={"model": "s-chat", "messages": MSG, "max_tokens": 20})

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: httpx.get(url + "/api/status", timeout=30).json()["tenants"]["team"][
        "in_flight"] == 1, 10, "the first request running", interval=0.01)
    return t


def test_openai_client_rate_limit_error_and_retry(hub) -> None:  # type: ignore[no-untyped-def]
    h, audit = hub
    t = hold_the_place(h.url)
    oc = openai.OpenAI(base_url=h.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.RateLimitError) as ei:
        oc.chat.completions.create(model="s-chat", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    assert ei.value.code == "rate_limit_exceeded"
    assert ei.value.response.headers["retry-after"] == "1"
    t.join()

    t = hold_the_place(h.url)
    t0 = time.monotonic()
    retrying = openai.OpenAI(base_url=h.url + "/v1", api_key=KEY, max_retries=3, timeout=30)
    out = retrying.chat.completions.create(model="s-chat", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    waited = time.monotonic() - t0
    t.join()
    assert out.choices[0].message.content
    assert waited >= 1.0  # the Retry-After, not the SDK's own 0.5 s first backoff
    lines = [json.loads(x) for x in Path(audit).read_text().splitlines()]
    statuses = [x["status"] for x in lines if x.get("client") == "team"]
    assert statuses.count(429) >= 2


def test_anthropic_client_rate_limit_error_and_retry(hub) -> None:  # type: ignore[no-untyped-def]
    h, _ = hub
    t = hold_the_place(h.url)
    ac = anthropic.Anthropic(base_url=h.url, api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(anthropic.RateLimitError) as ei:
        ac.messages.create(model="s-chat", max_tokens=2, messages=MSG)  # type: ignore[arg-type]
    assert ei.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert ei.value.response.headers["retry-after"] == "1"
    t.join()

    t = hold_the_place(h.url)
    t0 = time.monotonic()
    retrying = anthropic.Anthropic(base_url=h.url, api_key=KEY, max_retries=3, timeout=30)
    msg = retrying.messages.create(model="s-chat", max_tokens=2, messages=MSG)  # type: ignore[arg-type]
    waited = time.monotonic() - t0
    t.join()
    assert msg.content and waited >= 1.0
