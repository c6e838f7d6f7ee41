"""Every line-framed format survives every Unicode line break (appliance/http/lines.py).

A reader that splits on Unicode line breaks (str.splitlines, httpx's aiter_lines) must read
what we write as the same lines as one that splits on b"\\n"; and our own readers split on
b"\\n" only, so a peer that writes U+2028 raw (an older node) is still read whole.
"""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.http.lines import LineReader, LineTooLong, escape_breaks, iter_lines
from appliance.hub.observe.audit import AuditLog
from appliance.hub.translate import anthropic, ollama, responses
from appliance.wire import (
    EngineInstall,
    Heartbeat,
    ModelMeta,
    ModelState,
    NodeState,
    StateEvent,
    encode_event,
    watch_decoder,
)
from tests.harness.watch import supervising

# Every character str.splitlines splits on (and so httpx's aiter_lines).
BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
texts = st.lists(st.one_of(st.sampled_from(BREAKS), st.text(max_size=4)),
                 max_size=6).map("".join)
FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def one_line(data: bytes) -> str:
    """`data` is one `\\n`-ended line that every kind of reader reads as one line."""
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    text = data.decode()
    assert text.splitlines() == [text[:-1]], "a Unicode line break left raw"
    return text


def lines_alike(data: bytes) -> list[str]:
    """The lines of `data` read by splitlines equal those read on b"\\n" (a \\r\\n aside)."""
    text = data.decode()
    by_newline = [x.removesuffix("\r") for x in text.split("\n")]
    if by_newline and by_newline[-1] == "":
        by_newline.pop()
    assert text.splitlines() == by_newline, "a Unicode line break left raw"
    return by_newline


@st.composite
def node_states(draw) -> NodeState:
    t = lambda: draw(texts)  # noqa: E731
    meta = ModelMeta(digest=t(), modified_at=t(), format=t(), family=t(), families=[t(), t()],
                     parameter_size=t(), quantization_level=t(), capabilities=[t()])
    model = ModelState(name=t(), last_error=t(), meta=meta)
    return NodeState(name=t(), version=t(), engines=[EngineInstall(kind=t(), version=t())],
                     engine=t(), over_limits_reason=t(), models=[model])


@FAST
@given(state=node_states(), cut=st.integers(1, 7))
def test_a_watch_line_is_one_line_for_every_reader_whatever_its_strings(state, cut):
    line = encode_event(StateEvent(state=state))
    one_line(line)
    reader = LineReader(1 << 20)
    got = [x for i in range(0, len(line), cut) for x in reader.feed(line[i:i + cut])]
    assert len(got) == 1 and watch_decoder.decode(got[0]) == StateEvent(state=state)


@FAST
@given(record=st.dictionaries(st.sampled_from(["client", "model", "path", "error", "node"]),
                              texts, min_size=1))
def test_an_audit_line_is_one_line_whatever_a_client_names(tmp_path_factory, record):
    path = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    log = AuditLog(str(path))
    log.write({"kind": "request", **record})
    log.write({"kind": "request", "model": "after"})
    lines = lines_alike(path.read_bytes())
    assert [json.loads(x) for x in lines] == [{"kind": "request", **record},
                                              {"kind": "request", "model": "after"}]


def sse(*objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o, ensure_ascii=False).encode() + b"\n\n"
                    for o in objs) + b"data: [DONE]\n\n"


@FAST
@given(content=texts, thought=texts, args=texts, name=texts, model=texts)
def test_translated_answers_keep_their_framing_whatever_the_engine_says(content, thought,
                                                                        args, name, model):
    # An engine (vLLM writes UTF-8 raw) answers text, reasoning and a tool call holding
    # line breaks; every translation's lines read alike for both kinds of reader.
    data = sse({"choices": [{"index": 0, "delta": {"content": content,
                                                   "reasoning_content": thought}}]},
               {"choices": [{"index": 0, "delta": {"tool_calls": [
                   {"index": 0, "id": "c1", "type": "function",
                    "function": {"name": name, "arguments": args}}]}}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    for conv in (ollama.ChatConverter(model, stream=True, chat=True),
                 ollama.ChatConverter(model, stream=True, chat=False),
                 anthropic.MessagesConverter(model, stream=True),
                 responses.ResponsesConverter(model, stream=True, echo={"model": model})):
        out = conv.feed(data) + conv.end()
        lines = lines_alike(out)
        for x in lines:
            if x.startswith("data: "):
                json.loads(x[6:])
            elif x.startswith("{"):
                json.loads(x)


def test_escape_breaks_is_the_same_json_value():
    raw = msgspec.json.encode({"m": "a\x85b\u2028c\u2029d\u00e9\u20ac"})
    assert b"\xe2\x80\xa8" in raw  # msgspec leaves it raw: what escape_breaks is for
    out = escape_breaks(raw)
    assert out == b'{"m":"a\\u0085b\\u2028c\\u2029d\xc3\xa9\xe2\x82\xac"}'
    assert msgspec.json.decode(out) == msgspec.json.decode(raw)


def test_the_line_reader_splits_on_newline_only_and_bounds_a_line():
    r = LineReader(8)
    assert r.feed("a\u2028b\n".encode()) == ["a\u2028b".encode()]
    assert r.feed(b"12345") == [] and r.feed(b"6\r\nxy") == [b"123456\r"]
    assert r.tail() == b"xy"
    with pytest.raises(LineTooLong):
        r.feed(b"0123456789")
    with pytest.raises(LineTooLong):
        LineReader(4).feed(b"0123456789\nok\n")
    assert list(iter_lines([b"a\xe2\x80", b"\xa8b\nc"], 100)) == ["a\u2028b".encode(), b"c"]


async def test_the_hub_reads_a_watch_line_holding_a_raw_u2028_whole(autojump_clock):
    # An older node (or any peer) writes U+2028 raw, as msgspec does: the hub splits on
    # b"\n" only, so the node stays up and its model is ready under its own name.
    state = NodeState(name="a", models=[ModelState(name="x\u2028y", state="ready"),
                                        ModelState(name="m\x85", state="ready")])
    raw = msgspec.json.encode(StateEvent(state=state)) + b"\n"
    assert b"\xe2\x80\xa8" in raw

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield raw
            while True:
                await trio.sleep(1)
                yield encode_event(Heartbeat())

    async with supervising(lambda request: httpx.Response(200, stream=Stream())) as s:
        await trio.sleep(60)
        assert s.h.connected and s.h.ready("x\u2028y") and s.h.ready("m\x85")
    assert [(k, r) for k, _, r in s.events] == [("node_up", "")]


async def test_a_watch_line_past_its_bound_loses_the_node(autojump_clock, monkeypatch):
    import appliance.hub.fleet.supervisor as sup
    monkeypatch.setattr(sup, "MAX_WATCH_LINE", 1000)

    class Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            while True:
                yield b"x" * 100
                await trio.sleep(0.1)

    async with supervising(lambda request: httpx.Response(200, stream=Stream()),
                           connected=True) as s:
        await trio.sleep(1.5)
    assert s.events and s.events[0][0] == "node_lost" and "line over 1000 bytes" in s.events[0][2]
