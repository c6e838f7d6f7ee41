"""What an engine says of its prompt cache, read once with its usage (translate/usage.py)."""

from __future__ import annotations

import msgspec
import pytest

from appliance.hub.translate.usage import SSEMeter, openai_usage


@pytest.mark.parametrize("body,want", [
    (b'{"usage":{"prompt_tokens":100,"prompt_tokens_details":{"cached_tokens":64}}}', (100, 64)),
    (b'{"timings":{"cache_n":80,"prompt_n":20},"usage":{"prompt_tokens":100}}', (100, 80)),
    (b'{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":99}}}', (10, 10)),
    (b'{"usage":{"prompt_tokens":100}}', None),
    (b'{"usage":{"prompt_tokens":100,"prompt_tokens_details":null}}', None),
    (b'{"usage":{"prompt_tokens":true,"prompt_tokens_details":{"cached_tokens":1}}}', None),
])
def test_the_engines_cache_comes_with_its_usage(body: bytes, want) -> None:
    u = openai_usage(msgspec.json.decode(body))
    assert u is not None and u.cache == want


def test_a_stream_reports_its_cache_from_the_usage_event() -> None:
    m = SSEMeter(prompt=5, drop=False)
    m.feed(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    m.feed(b'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":1},'
           b'"timings":{"cache_n":90,"prompt_n":10}}\n\ndata: [DONE]\n\n')
    m.end()
    u = m.usage()
    assert (u.input, u.output, u.cache) == (100, 1, (100, 90))
