"""A params mutant that survived issue 30's round (item 10)."""

from __future__ import annotations

import json

from appliance.node.engines.params import LLAMA_CPP_PYTHON, fit


def test_the_cap_rewrite_holds_when_json_schema_appears_only_as_text() -> None:
    # Mutant: the schema rewrite's "nothing to do" overwrote the cap rewrite's "changed",
    # so a prompt that merely says "json_schema" lost its max_completion_tokens rewrite.
    body = json.dumps({"model": "m", "max_completion_tokens": 5,
                       "messages": [{"role": "user", "content": "explain json_schema"}]}).encode()
    out = json.loads(fit(LLAMA_CPP_PYTHON, "/v1/chat/completions", body))
    assert out["max_tokens"] == 5 and "max_completion_tokens" not in out
    assert out["messages"][0]["content"] == "explain json_schema"
