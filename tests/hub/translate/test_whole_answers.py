"""A translated non-streamed answer is gathered in pieces and joined once, bounded (issue 30
item 8): `bytes +=` per chunk copied everything so far each time -- a 200 MB engine answer
through /v1/messages held a core for minutes and never answered."""

from __future__ import annotations

import json

import pytest

from appliance.hub.translate import anthropic, common, ollama, responses


class Piece(bytes):
    """A chunk that fails the test when it is concatenated onto what came before."""

    def __radd__(self, other: bytes) -> bytes:
        raise AssertionError("a whole answer is concatenated chunk by chunk")


ANSWER = {"id": "x", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello " * 500},
                       "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 500, "total_tokens": 503}}


def pieces(data: bytes, size: int = 64) -> list[bytes]:
    return [Piece(data[i:i + size]) for i in range(0, len(data), size)]


@pytest.mark.parametrize("make", [
    lambda: anthropic.MessagesConverter("m", stream=False),
    lambda: responses.ResponsesConverter("m", stream=False, echo={"model": "m"}),
    lambda: anthropic.CountConverter(),
    lambda: ollama.EmbedConverter("m", legacy=False),
])
def test_a_whole_answer_is_joined_once(make) -> None:
    conv = make()
    data = json.dumps(ANSWER).encode()
    for p in pieces(data):
        assert conv.feed(p) == b""
    out = json.loads(conv.end())
    assert out  # an answer, whichever API's shape


def test_the_messages_answer_is_whole_and_right() -> None:
    conv = anthropic.MessagesConverter("m", stream=False)
    for p in pieces(json.dumps(ANSWER).encode(), 7):
        conv.feed(p)
    out = json.loads(conv.end())
    assert out["content"][0]["text"] == "hello " * 500
    assert out["usage"]["output_tokens"] == 500


def test_an_answer_past_the_bound_is_dropped_not_held(monkeypatch) -> None:
    monkeypatch.setattr(common, "MAX_WHOLE_BYTES", 1000)
    w = common.Whole()
    for _ in range(10):
        w.add(b"x" * 300)
    assert w.over and w.parts == [] and w.take() == b""
