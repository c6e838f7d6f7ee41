"""Small parts of the request path: Flag, remembered metric children, the finish listener."""

from __future__ import annotations

from functools import partial

import trio
from prometheus_client import CollectorRegistry, Counter, Histogram

from appliance.bounds import Children
from appliance.http.stream import Cut
from appliance.hub.fleet.nodes import Flag, Registry


async def test_a_flag_calls_its_subscribers_once_and_wakes_its_waiters():
    f = Flag()
    calls: list[str] = []
    a, b = partial(calls.append, "a"), partial(calls.append, "b")
    f.subscribe(a)
    f.subscribe(b)
    f.unsubscribe(b)
    woke = []

    async def waiter():
        await f.wait()
        woke.append(True)

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.sleep(0)
        assert not f.is_set() and calls == []
        f.set()
        f.set()  # once
        assert calls == ["a"]
    assert woke == [True] and f.is_set() and f.subscribers() == 0
    f.subscribe(partial(calls.append, "late"))  # already set: at once
    assert calls == ["a", "late"]


async def test_a_cut_subscribed_to_a_flag_cancels_the_read_in_progress():
    f, cut = Flag(), Cut()
    f.subscribe(partial(cut.trip, "node_lost"))
    async with trio.open_nursery() as n:
        n.start_soon(lambda: _set_soon(f))
        with cut.reading():
            await trio.sleep_forever()
    assert cut.reason == "node_lost"


async def _set_soon(f: Flag) -> None:
    await trio.sleep(0)
    f.set()


def _value(reg: CollectorRegistry, name: str, labels: dict) -> float | None:
    return reg.get_sample_value(name, labels)


def test_remembered_children_still_count_per_label():
    reg = CollectorRegistry()
    c = Counter("x_requests", "", ["client", "status"], registry=reg)
    h = Histogram("x_seconds", "", ["model"], buckets=(1, 2), registry=reg)
    cs, hs = Children(c), Children(h)
    for _ in range(3):
        cs("a", "200").inc()
    cs("a", "503").inc()
    cs("b", "200").inc()
    hs("m").observe(0.5)
    hs("m").observe(1.5)
    assert cs("a", "200") is c.labels("a", "200")  # the same child the metric holds
    assert _value(reg, "x_requests_total", {"client": "a", "status": "200"}) == 3
    assert _value(reg, "x_requests_total", {"client": "a", "status": "503"}) == 1
    assert _value(reg, "x_requests_total", {"client": "b", "status": "200"}) == 1
    assert _value(reg, "x_seconds_bucket", {"model": "m", "le": "1.0"}) == 1
    assert _value(reg, "x_seconds_count", {"model": "m"}) == 2


def test_a_finish_calls_the_finish_listener_and_a_change_every_listener():
    r = Registry()
    every, finishes, control = [], [], []
    r.add_listener(lambda: every.append(1))
    r.add_listener(lambda: control.append(1), on_finish=lambda: finishes.append(1))
    h, _ = r.upsert("n", "http://n:1", static=True)
    every.clear(), control.clear()
    r.start(h, "m")
    r.finish(h, "m")
    assert (len(every), len(finishes), len(control)) == (1, 1, 0)
    r.changed()
    assert (len(every), len(finishes), len(control)) == (2, 1, 1)


def test_made_request_ids_are_unique_hex_and_a_clients_sane_one_is_kept():
    from appliance.hub.api.request import MAX_LEN, make, request_id

    ids = {make() for _ in range(20000)}
    assert len(ids) == 20000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert request_id([(b"x-request-id", b"abc-123")]) == "abc-123"
    assert request_id([(b"x-request-id", b"x" * MAX_LEN)]) == "x" * MAX_LEN
    for bad in (b"", b"a b", b"a\r\nb", b"x" * (MAX_LEN + 1), "é".encode()):
        made = request_id([(b"x-request-id", bad)])
        assert made != bad.decode("latin-1") and len(made) == 32


BODIES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}',
    b'{"model": "m", "keep_alive": "5m", "x": {"deep": [1, 2, {"a": null}]}}',
    b'{"model": "m", "model": "n"}',
    b'{"model": 5}', b'{"stream": true}', b'{"model": "m", "stream": 1}', b"[1, 2]", b'"m"',
    b"", b"{", b'{"model": "m"', b'{"model": 5, "x": ', b"nul", b"[" * 100000 + b"]" * 100000,
    b'{"model": "m", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
]


def test_one_decode_answers_what_two_did():
    from appliance.http.errors import ApiError
    from appliance.hub.api.router import decode_body, decode_request
    from appliance.hub.translate import decode_object

    for body in BODIES:
        try:
            want = (decode_request(body), decode_object(body))
        except ApiError as e:
            want = e
        try:
            got = decode_body(body)
        except ApiError as e:
            got = e
        if isinstance(want, ApiError):
            assert isinstance(got, ApiError), body[:40]
            assert (got.status, got.code, got.message) == (want.status, want.code,
                                                           want.message), body[:40]
        else:
            assert not isinstance(got, ApiError), body[:40]
            assert (got[0].model, got[0].stream, got[0].keep_alive, got[1]) == (
                want[0].model, want[0].stream, want[0].keep_alive, want[1])


def test_one_record_for_the_audit_line_the_recent_rows_and_the_slowest(tmp_path):
    import json
    import time

    from appliance.hub.api.request import JSON_BODY, Recorder, Request
    from appliance.hub.observe.audit import AuditLog, Recent, SlowRequests
    from appliance.hub.observe.metrics import HubMetrics

    async def send(msg):
        pass

    recent, slow = Recent(), SlowRequests()
    rec = Recorder(AuditLog(str(tmp_path / "audit.log")), recent, slow,
                   HubMetrics(CollectorRegistry(), Registry()), False)
    headers = [(b"authorization", b"Bearer sk-secret"), (b"user-agent", b"t/1"),
               (b"x-request-id", b"rid-1"), (b"accept", b"text/event-stream")]
    req = Request({"type": "http", "path": "/v1/chat/completions", "headers": headers}, send,
                  "openai", rec)
    # The headers are read once: the id and the ones the node sees (never the key).
    assert req.id_headers == [(b"x-request-id", b"rid-1")]
    assert req.forwarded == [JSON_BODY, (b"user-agent", b"t/1"),
                             (b"accept", b"text/event-stream")]
    req.identified("team")
    req.resolved("m" * 300, "other", "normal")
    req.refused(404, "model_not_found")
    req.finish()
    line = json.loads((tmp_path / "audit.log").read_text())
    assert line["request_id"] == "rid-1" and line["client"] == "team"
    # The same record, not a copy per feed; each feed picks its fields when read.
    assert list(recent) == [line] and "kind" not in recent.payload()["requests"][0]
    row = slow.slowest(1, time.time())[0]
    assert row["status"] == 404 and len(row["model"]) == 200 and "kind" not in row
