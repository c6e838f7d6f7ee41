"""Usage mutants that survived issue 30's round (item 10), one test each."""

from __future__ import annotations

import json

from appliance.hub.translate.usage import SSEMeter, estimate, prompt_estimate, text_bytes


def test_a_short_data_field_is_text_not_an_image() -> None:
    # Mutant: every `"data":"..."` counted as an image's base64 (only a long one is).
    text = "a" * 200
    body = json.dumps({"x": [{"type": "t", "data": text}]}, separators=(",", ":")).encode()
    assert prompt_estimate(body) == estimate(len(body))
    image = json.dumps({"x": [{"type": "image", "data": "Q" * 4000}]},
                       separators=(",", ":")).encode()
    assert prompt_estimate(image) < estimate(200)  # a long one is an image: left out


def test_dropping_the_usage_chunk_keeps_one_that_carries_a_finish_reason() -> None:
    # Mutant: any chunk naming usage dropped -- llama.cpp sends finish_reason with it.
    last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    only = {"choices": [], "usage": last["usage"]}
    events = [b"data: " + json.dumps(o).encode() + b"\n\n" for o in (last, only)]
    m = SSEMeter(0, drop=True)
    out = m.feed(b"".join(events)) + m.end()
    assert out == events[0]  # the finish_reason stays; the usage-only chunk goes
    assert m.usage() is not None and (m.usage().input, m.usage().output) == (5, 2)


def test_text_is_counted_in_bytes_not_characters() -> None:
    # Mutant: len(text) instead of its UTF-8 bytes (a token is at least one byte).
    assert text_bytes("\u00e9\u20ac") == 5
    assert text_bytes({"content": ["\u00e9", {"text": "\u20ac"}]}) == 5
