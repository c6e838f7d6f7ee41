"""The store's pure parts: the multipart reader, object ids, a batch's line checks and
output shapes, and the SQLite tables (ownership, pages, lines pending until committed)."""

from __future__ import annotations

import json

import msgspec
import pytest

from appliance.http.multipart import Done, MultipartError, Part, PartEnd, Reader, boundary_of
from appliance.hub.store import ids, lines
from appliance.hub.store.db import Db, Obj

BOUNDARY = "----xyz"


def form(fields: dict[str, str], content: bytes, filename: str = "in.jsonl") -> bytes:
    out = b""
    for k, v in fields.items():
        out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n"
                ).encode()
    out += (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()
    return out + content + f"\r\n--{BOUNDARY}--\r\n".encode()


def read(body: bytes, step: int) -> tuple[dict[str, bytes], list[Part]]:
    r = Reader(BOUNDARY)
    got: dict[str, bytes] = {}
    parts: list[Part] = []
    cur = ""
    done = False
    for i in range(0, len(body), step):
        for e in r.feed(body[i:i + step]):
            if isinstance(e, Part):
                parts.append(e)
                cur = e.name
                got[cur] = b""
            elif isinstance(e, bytes):
                got[cur] += e
            elif isinstance(e, Done):
                done = True
            else:
                assert isinstance(e, PartEnd)
    assert done
    return got, parts


@pytest.mark.parametrize("step", [1, 3, 7, 64, 100000])
def test_multipart_any_chunking_gives_the_same_parts(step):
    # content that holds the delimiter's start, CRLFs and dashes, split anywhere
    content = b"a\r\n--" + BOUNDARY[:-1].encode() + b"\r\n\r\n--x" * 50 + b"\r\n-"
    got, parts = read(form({"purpose": "batch"}, content), step)
    assert got == {"purpose": b"batch", "file": content}
    assert parts[1].filename == "in.jsonl" and parts[0].filename is None


def test_multipart_holds_back_at_most_a_delimiter():
    r = Reader(BOUNDARY)
    head = form({}, b"")[: -len(f"\r\n--{BOUNDARY}--\r\n")]
    r.feed(head)
    out = r.feed(b"x" * 1_000_000)
    assert sum(len(e) for e in out if isinstance(e, bytes)) >= 1_000_000 - len(BOUNDARY) - 4
    assert len(r.buf) <= len(BOUNDARY) + 4


def test_multipart_refuses_a_huge_part_head_and_finds_boundaries():
    r = Reader(BOUNDARY)
    with pytest.raises(MultipartError):
        r.feed(f"--{BOUNDARY}\r\n".encode() + b"X" * 20000)
    assert boundary_of('multipart/form-data; boundary="ab c"') == "ab c"
    assert boundary_of("multipart/form-data; charset=x; boundary=abc") == "abc"
    assert boundary_of("application/json") is None


def test_ids_name_their_hub():
    oid = ids.new("batch_", "hub-a.lan")
    assert oid.startswith("batch_hub-a.lan-") and ids.holder(oid, "batch_") == "hub-a.lan"
    assert ids.holder(oid, "file-") is None
    assert ids.holder("batch_abc", "batch_") is None
    assert ids.holder("batch_x/../y" + "0" * 30, "batch_") is None
    assert ids.new("file-", "we ird/name").startswith("file-we-ird-name-")


def _line(cid, url="/v1/chat/completions", **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": "m", **body}}).encode()


def test_check_lines_bad_lines_are_error_rows_and_the_rest_run():
    raw = [_line("a", stream=True), b"{not json", b"[1]", b"", _line("a"),
           _line("b", url="/v1/embeddings"), json.dumps({"custom_id": "c", "body": {}}).encode(),
           _line("d")]
    rows = list(lines.check_lines(raw, "/v1/chat/completions", 100))
    assert [r[2] for r in rows] == ["pending", "failed", "failed", "failed", "failed", "failed",
                                    "pending"]
    assert [r[0] for r in rows] == list(range(7))  # the empty line is not a line
    assert "stream" not in json.loads(rows[0][3])  # a batch keeps whole answers
    dup = json.loads(rows[3][4])["error"]
    assert dup["code"] == "duplicate_custom_id" and dup["message"].startswith("line 4:")
    assert json.loads(rows[1][4])["error"]["code"] == "invalid_json"


def test_check_lines_bounds_the_count_at_batch_max_lines():
    assert len(list(lines.check_lines((_line(f"x{i}") for i in range(10)),
                                      "/v1/chat/completions", 10))) == 10
    with pytest.raises(ValueError, match="Batch__MaxLines=10"):
        list(lines.check_lines((_line(f"x{i}") for i in range(11)), "/v1/chat/completions", 10))


def test_store_bounds_are_settings_validated_at_start():
    from appliance.config import ConfigError, load

    cfg = load({"Store__MaxObjectsPerKey": "3", "Batch__MaxLines": "7"})
    assert cfg.store.max_objects_per_key == 3 and cfg.batch.max_lines == 7
    assert load({}).store.max_objects_per_key == 100_000 and load({}).batch.max_lines == 50_000
    for bad in ({"Store__MaxObjectsPerKey": "0"}, {"Batch__MaxLines": "0"},
                {"Batch__MaxLines": "2000000"}, {"Store__MaxObjectsPerKey": "x"}):
        with pytest.raises(ConfigError, match=next(iter(bad)).split("__")[1]):
            load(bad)


async def test_objects_per_key_follow_the_setting_and_a_reload(tmp_path):
    from prometheus_client import CollectorRegistry

    from appliance.config import StoreConfig
    from appliance.http.errors import ApiError
    from appliance.hub.store.store import open_store

    cfg = StoreConfig(path=str(tmp_path / "store.db"), max_objects_per_key=2)
    store = open_store(cfg, "h", CollectorRegistry())
    assert store is not None
    for i in range(2):
        await store.check_quota("a")
        await store.put(Obj(f"resp_h-{i}", "response", "a", 1, None, 1, "completed", {}))
    with pytest.raises(ApiError) as e:
        await store.check_quota("a")
    assert e.value.status == 507 and "Store__MaxObjectsPerKey" in str(e.value)
    await store.check_quota("b")  # another key has its own share
    store.reload(msgspec.structs.replace(cfg, max_objects_per_key=3))
    await store.check_quota("a")


def test_output_shapes():
    ok = json.loads(lines.result(200, {"x": 1}, "rid"))
    assert lines.openai_line("c", ok) == {"id": ok["id"], "custom_id": "c", "error": None,
                                          "response": {"status_code": 200, "request_id": "rid",
                                                       "body": {"x": 1}}}
    assert lines.anthropic_line("c", "completed", ok)["result"] == {"type": "succeeded",
                                                                     "message": {"x": 1}}
    refused = json.loads(lines.result(404, {"type": "error", "error": {
        "type": "not_found_error", "message": "no"}}, "rid"))
    assert lines.anthropic_line("c", "failed", refused)["result"]["error"]["error"]["type"] \
        == "not_found_error"
    assert lines.anthropic_line("c", "cancelled", None) == {"custom_id": "c",
                                                            "result": {"type": "canceled"}}
    assert lines.encode_line({"t": "a\u2028b"}) == b'{"t":"a\\u2028b"}\n'


def _obj(oid: str, owner: str, t: int, kind: str = "file") -> Obj:
    return Obj(oid, kind, owner, t, None, 10, "", {"id": oid})


def test_db_ownership_pages_and_lines(tmp_path):
    db = Db(str(tmp_path / "s" / "store.db"))
    for i in range(5):
        db.put(_obj(f"f{i}", "alice" if i % 2 == 0 else "bob", 100 + i))
    assert db.get("file", "f1", "alice") is None  # bob's: alice cannot see it
    assert db.get("file", "f1", None) is not None  # the admin can
    page, more = db.page("file", "alice", None, 2)
    assert [o.id for o in page] == ["f4", "f2"] and more
    page, more = db.page("file", "alice", "f2", 2)
    assert [o.id for o in page] == ["f0"] and not more
    assert [o.id for o in db.page("file", None, None, 10, newest_first=False)[0]] == [
        "f0", "f1", "f2", "f3", "f4"]
    b = _obj("b1", "alice", 1, "batch")
    b.state = "in_progress"
    db.add_lines(b, [(0, "x", "pending", "{}", None), (1, "y", "failed", None, "{}"),
                     (2, "z", "pending", "{}", None)])
    assert [r[0] for r in db.pending("b1")] == [0, 2]
    b.data["n"] = 1
    db.line_done(b, 0, "completed", '{"ok":1}')
    db.line_done(b, 0, "failed", '{"twice":1}')  # a line's result is committed once
    assert db.results("b1")[0][2:] == ("completed", '{"ok":1}')
    assert db.get("batch", "b1", None).data["n"] == 1
    assert db.line_states("b1") == {"completed": 1, "failed": 1, "pending": 1}
    assert db.cancel_pending(b, "cancelled", "{}") == 1
    assert [o.id for o in db.in_state("batch", ["in_progress"])] == ["b1"]
    db.close()
    again = Db(str(tmp_path / "s" / "store.db"))  # reopened: everything is there
    assert again.line_states("b1") == {"completed": 1, "failed": 1, "cancelled": 1}
    assert again.total_bytes() > 50
    again.delete("b1")
    assert again.line_states("b1") == {} and again.get("batch", "b1", None) is None


def test_db_items_in_order(tmp_path):
    db = Db(str(tmp_path / "store.db"))
    db.add_items("c", [("i1", {"id": "i1"}), ("i2", {"id": "i2"})])
    db.add_items("c", [("i3", {"id": "i3"})])
    assert [i["id"] for i in db.items("c", None, 10, False)[0]] == ["i1", "i2", "i3"]
    assert [i["id"] for i in db.items("c", "i3", 1, True)[0]] == ["i2"]
    assert db.delete_item("c", "i2") and not db.delete_item("c", "i2")
    assert msgspec.json.encode(db.item("c", "i1")) == b'{"id":"i1"}'


def test_ctl_batches_table_shows_both_kinds_with_progress():
    from appliance.ctlbatches import table

    out = table([{"id": "batch_h-1", "status": "in_progress", "endpoint": "/v1/embeddings",
                  "request_counts": {"total": 4, "completed": 1, "failed": 1}},
                 {"id": "msgbatch_h-2", "type": "message_batch", "processing_status": "ended",
                  "request_counts": {"processing": 0, "succeeded": 2, "errored": 1,
                                     "canceled": 1, "expired": 0}}])
    lines = out.splitlines()
    assert lines[0].split() == ["BATCH", "STATUS", "ENDPOINT", "DONE", "FAILED"]
    assert lines[1].split() == ["batch_h-1", "in_progress", "/v1/embeddings", "2/4", "(50%)",
                                "1"]
    assert lines[2].split() == ["msgbatch_h-2", "ended", "/v1/messages", "4/4", "(100%)", "1"]
    assert table([]) == "no batches"


async def test_sweep_drops_what_expired_and_keeps_running_batches(tmp_path):
    from prometheus_client import CollectorRegistry

    from appliance.config import StoreConfig
    from appliance.hub.store.store import open_store

    store = open_store(StoreConfig(path=str(tmp_path / "store.db")), "h", CollectorRegistry())
    assert store is not None
    old = Obj("resp_h-1", "response", "a", 1, 2, 100, "completed", {})
    fresh = Obj("resp_h-2", "response", "a", 1, 2 ** 40, 100, "completed", {})
    running = Obj("batch_h-3", "batch", "a", 1, 2, 0, "in_progress", {})
    with open(store.file_path("file-h-4"), "wb") as f:
        f.write(b"x" * 10)
    gone_file = Obj("file-h-4", "file", "a", 1, 2, 10, "batch", {})
    for o in (old, fresh, running, gone_file):
        await store.put(o)
    assert store.total == 210
    await store.sweep()
    left = {o.id for k in ("response", "batch", "file")
            for o in (await store.run(store.db.page, k, None, None, 10))[0]}
    assert left == {"resp_h-2", "batch_h-3"}
    assert not (tmp_path / "files" / "file-h-4").exists()
    assert store.total == 100
