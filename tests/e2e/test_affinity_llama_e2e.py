"""End to end on llama.cpp's own llama-server: a hub and three `Engine__Kind=llamacpp` nodes,
the tiny GGUF (tests/harness/make_gguf.py) ready on all three; the second turn of a conversation
lands on the first turn's node, and llama-server reports its prompt as cached.

The server is the cached build of tests/harness/llama_cache.py (`make llama-server`); where it is
not built the test is skipped, saying so. One slot per server (`-np 1`), so what the slot
holds is the conversation just served there; each conversation's two turns go back to back.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_clients_matrix import LLAMA_SERVER
from tests.harness import make_gguf
from tests.harness.fleet import Fleet

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.e2e,
    pytest.mark.skipif(LLAMA_SERVER is None,
                       reason="llama-server not built here: `make llama-server`"),
]

TOKEN = "affinity-llama"
NODES = ("gpu-a", "gpu-b", "gpu-c")
# The tiny model's context is 256 tokens (~4 a word with its vocabulary): blocks of 32
# bytes make a 25-word prompt a chain of several (the default 256 would make none).
BLOCK = 32
WORDS = make_gguf.WORDS


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("affinity-llama")
    tiny, _ = make_gguf.write_pair(tmp, seed=3)
    f = Fleet(tmp, token=TOKEN)
    try:
        f.start_hub({"Audit__Path": f.audit_path, "Router__AffinityBlockChars": str(BLOCK),
                     "Hub__ControlIntervalSeconds": "0.2",
                     "Models__0__Name": "tiny", "Models__0__Source": str(tiny),
                     "Models__0__Replicas": "3"})
        command = (f"{LLAMA_SERVER} -m {{model}} --host 127.0.0.1 --port {{port}} -c 256 -t 1 "
                   "-np 1 {args}")
        for name in NODES:
            f.start_node(name, {"Node__AnnounceSeconds": "1", "Node__MemoryMb": "1000",
                                "Engine__Kind": "llamacpp", "Engine__Command": command,
                                "Engine__StartTimeoutSeconds": "60"})
        f.wait(lambda: f.models().get("tiny", {}).get("ready") == 3,
               "tiny ready on three llama-servers", 120)
        yield f
    finally:
        f.close()


ASK = {"max_tokens": 4, "temperature": 0, "timeout": 60}  # each turn, greedy


def cached_of(answer: dict) -> int:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return int(details["cached_tokens"])
    return int((answer.get("timings") or {}).get("cache_n", 0))


def test_turn_two_lands_on_turn_ones_node_and_llama_server_reports_it_cached(fleet):
    f = fleet
    answers = []
    for i in range(3):
        ctx = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(25))
        msgs = [{"role": "system", "content": ctx}, {"role": "user", "content": "what is it"}]
        first = f.answer("tiny", messages=msgs, **ASK)
        msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and then"}]
        answers.append(f.answer("tiny", messages=msgs, **ASK))
    lines = f.audit("request")
    assert len(lines) == 6
    for turn1, turn2, answer in zip(lines[0::2], lines[1::2], answers, strict=True):
        assert turn2["node"] == turn1["node"] and turn2["routing"] == "prefix"
        assert cached_of(answer) > 0, answer
    routing = f.models()["tiny"]["routing"]
    assert routing["cached_prompt_tokens"] > 0 and routing["confirmed_hits"] >= 1
