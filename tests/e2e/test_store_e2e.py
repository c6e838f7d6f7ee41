"""End to end: files, OpenAI batches and Anthropic message batches through a real hub on
the sim, with the official clients -- bad lines, ownership, bounds, restart and kill -9.

The node is static (`Nodes__0__Url`), so a restarted hub finds it again at once; every hub
here has its own store in the test's folder.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.harness.fleet import Fleet
from tests.harness.procs import Procs, wait_until

pytestmark = pytest.mark.e2e

ADMIN = "admin-key"
KEYS = {"Auth__RequireKeys": "true", "Auth__AdminKey": ADMIN,
        "Auth__Clients__0__Name": "alice", "Auth__Clients__0__Key": "ka",
        "Auth__Clients__1__Name": "bob", "Auth__Clients__1__Key": "kb"}


def chat_line(cid: str, model: str = "s-chat", tokens: int = 5) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "max_tokens": tokens,
                                "messages": [{"role": "user", "content": f"hello {cid}"}]}})


class Box:
    """One sim node, and a hub (restartable) with its store under `tmp`."""

    def __init__(self, procs: Procs, tmp: Path, env: dict[str, str] | None = None,
                 tps: str = "0", keys: bool = True) -> None:
        self.tmp = tmp
        self.fleet = Fleet(tmp, procs=procs, token=None, admin=ADMIN if keys else None)
        self.node = self.fleet.start_node("n1", {"Sim__Models__0__Name": "s-chat",
                                                 "Sim__TokensPerSecond": tps,
                                                 "Sim__Parallel": "8"}, announce=False)
        self.env = {"Store__Path": str(tmp / "state" / "store.db"),
                    "Audit__Path": str(tmp / "audit.jsonl"), "Nodes__0__Name": "n1",
                    "Nodes__0__Url": self.node.url, **(KEYS if keys else {}), **(env or {})}
        self.start()

    def start(self) -> None:
        """The hub, again after a stop: `fleet.hub` is the newest."""
        self.hub = self.fleet.start_hub(self.env, metrics=False)
        self.fleet.wait_up("n1")

    def status(self) -> dict:  # (the admin key; without keys the status is open)
        return self.fleet.status()

    def oai(self, key: str = "ka") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.hub.url + "/v1", api_key=key, max_retries=0)

    def audit(self) -> list[dict]:
        path = self.tmp / "audit.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def files_on_disk(self) -> list[str]:
        return sorted(os.listdir(self.tmp / "state" / "files"))


def wait_batch(c: openai.OpenAI, bid: str, timeout: float = 60):
    return wait_until(lambda: (b := c.batches.retrieve(bid)).status in (
        "completed", "failed", "cancelled", "expired") and b, timeout=timeout,
        what=f"batch {bid} ends")


def test_files_and_a_batch_with_bad_lines_and_an_unknown_model(procs, tmp_path):
    box = Box(procs, tmp_path)
    c = box.oai()
    text = "\n".join([chat_line("a"), "{oops", chat_line("b"), chat_line("ghost", "no-such"),
                      chat_line("a"), chat_line("c")]) + "\n"
    f = c.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert f.bytes == len(text) and f.purpose == "batch" and f.id.startswith("file-")
    assert c.files.content(f.id).content == text.encode()
    assert c.files.retrieve(f.id).filename == "in.jsonl"
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h", metadata={"run": "1"},
                         output_expires_after={"anchor": "created_at", "seconds": 7200})
    assert b.status == "validating" and b.metadata == {"run": "1"}
    b = wait_batch(c, b.id)
    assert b.status == "completed" and b.completed_at and b.in_progress_at
    assert (b.request_counts.total, b.request_counts.completed,
            b.request_counts.failed) == (6, 3, 3)
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    made = c.files.retrieve(b.output_file_id)
    assert made.purpose == "batch_output" and made.expires_at == made.created_at + 7200
    assert sorted(o["custom_id"] for o in out) == ["a", "b", "c"]
    assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"]
               for o in out)
    by_id = {e["custom_id"]: e for e in err}
    assert by_id["ghost"]["response"]["status_code"] == 404
    assert by_id["ghost"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert by_id[None]["error"]["message"].startswith("line 2:")
    assert by_id["a"]["error"]["code"] == "duplicate_custom_id"
    # one audit line per line that ran, with the batch id, at the key's name
    ran = [a for a in box.audit() if a.get("batch") == b.id]
    assert len(ran) == 4 and {a["client"] for a in ran} == {"alice"}
    assert {a["request_id"] for a in ran} >= {o["response"]["request_id"] for o in out}
    assert [x.id for x in c.batches.list()] == [b.id]
    # bob sees none of it: the same 404 as for an id that never existed
    bob = box.oai("kb")
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.batches.retrieve(b.id),
                 lambda: bob.files.content(f.id), lambda: bob.files.delete(f.id),
                 lambda: bob.batches.cancel(b.id), lambda: bob.files.retrieve("file-x")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "not_found"
    assert bob.files.list().data == [] and bob.batches.list().data == []
    with pytest.raises(openai.NotFoundError):  # alice's file is not bob's input
        bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                           completion_window="24h")
    admin = box.oai(ADMIN)
    assert {x.id for x in admin.files.list()} == {f.id, b.output_file_id, b.error_file_id}
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    assert admin.files.delete(b.error_file_id).deleted  # the admin deletes anyone's
    assert len(box.files_on_disk()) == 1
    # a restart keeps every object
    box.hub.signal(signal.SIGTERM)
    box.hub.wait_exit()
    box.start()
    c = box.oai()
    assert c.batches.retrieve(b.id).request_counts.completed == 3
    assert len(c.files.content(b.output_file_id).text.splitlines()) == 3


def test_kill_9_mid_batch_resumes_each_custom_id_once(procs, tmp_path):
    box = Box(procs, tmp_path, {"Batch__MaxConcurrent": "2"}, tps="40")
    c = box.oai()
    n = 24
    text = "\n".join(chat_line(f"r{i}", tokens=8) for i in range(n))
    f = c.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 6, timeout=60,
               what="a quarter done")
    box.hub.kill()  # SIGKILL: no drain, no goodbye
    box.start()
    c = box.oai()
    done = wait_batch(c, b.id, timeout=120)
    assert done.status == "completed" and done.request_counts.completed == n
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"r{i}" for i in range(n))
    ran = [a for a in box.audit() if a.get("batch") == b.id and a["status"] == 200]
    assert n <= len(ran) <= n + 2  # at most the lines in flight at the kill ran twice


def test_cancel_and_anthropic_message_batches(procs, tmp_path):
    box = Box(procs, tmp_path, {"Batch__MaxConcurrent": "1"}, tps="20")
    c = box.oai()
    text = "\n".join(chat_line(f"r{i}", tokens=20) for i in range(30))
    f = c.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_until(lambda: c.batches.retrieve(b.id).request_counts.completed >= 1, timeout=60,
               what="a line done")
    # visible while it runs: /api/status, the metrics, `ctl batches`
    running = box.status()["batches"]
    assert [x["id"] for x in running] == [b.id] and running[0]["total"] == 30
    assert running[0]["owner"] == "alice" and running[0]["completed"] >= 1
    code, said = box.fleet.ctl("batches")
    assert code == 0 and b.id in said and "in_progress" in said
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    done = wait_batch(c, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert done.request_counts.completed < 30
    errs = c.files.content(done.error_file_id).text.splitlines()
    assert json.loads(errs[-1])["error"]["code"] == "batch_cancelled"
    assert done.request_counts.completed + len(errs) == 30
    assert box.status()["batches"] == []
    metrics = httpx.get(box.hub.url + "/metrics", timeout=10,
                        headers={"authorization": f"Bearer {ADMIN}"}).text
    assert 'appliance_batch_lines_total{outcome="cancelled"}' in metrics
    assert "appliance_store_bytes " in metrics
    code, said = box.fleet.ctl("batches", "show", b.id)
    assert code == 0 and "cancelled" in said

    a = anthropic.Anthropic(base_url=box.hub.url, api_key="ka", max_retries=0)
    reqs = [{"custom_id": f"m{i}", "params": {"model": "s-chat", "max_tokens": 5,
                                              "messages": [{"role": "user", "content": "hi"}]}}
            for i in range(3)]
    reqs.append({"custom_id": "ghost", "params": {"model": "no-such", "max_tokens": 5,
                                                  "messages": [{"role": "user",
                                                                "content": "hi"}]}})
    mb = a.messages.batches.create(requests=reqs)
    assert mb.processing_status == "in_progress" and mb.request_counts.processing == 4
    wait_until(lambda: a.messages.batches.retrieve(mb.id).processing_status == "ended",
               timeout=60, what="message batch ended")
    got = a.messages.batches.retrieve(mb.id)
    assert (got.request_counts.succeeded, got.request_counts.errored) == (3, 1)
    results = {r.custom_id: r.result for r in a.messages.batches.results(mb.id)}
    assert results["m0"].type == "succeeded" and results["m0"].message.content[0].text
    assert results["ghost"].type == "errored"
    assert [x.id for x in a.messages.batches.list()] == [mb.id]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=box.hub.url, api_key="kb",
                            max_retries=0).messages.batches.retrieve(mb.id)
    with pytest.raises(anthropic.BadRequestError):  # a duplicate custom_id: the whole batch
        a.messages.batches.create(requests=[reqs[0], reqs[0]])
    assert a.messages.batches.delete(mb.id).type == "message_batch_deleted"


def _raw(url: str, head: bytes, body: bytes = b"") -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_uploads_bounded_and_a_full_store_keeps_what_it_had(procs, tmp_path):
    box = Box(procs, tmp_path, {"Store__MaxFileMb": "1", "Store__MaxTotalMb": "2"})
    c = box.oai()
    # a 2 GB upload said up front: refused before any of it is read
    head = (b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ka\r\n"
            b"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 2147483648\r\n\r\n")
    assert _raw(box.hub.url, head).startswith(b"HTTP/1.1 413")
    # sent chunked, with no length said: counted, and refused at the bound
    def chunks():
        yield b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\n"
        for _ in range(40):
            yield b"x" * 65536

    r = httpx.post(box.hub.url + "/v1/files", content=chunks(), timeout=30,
                   headers={"authorization": "Bearer ka",
                            "content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    assert box.files_on_disk() == []  # nothing left of it
    kept = c.files.create(file=("a.jsonl", io.BytesIO(b"x" * 900_000)), purpose="batch")
    c.files.create(file=("b.jsonl", io.BytesIO(b"x" * 900_000)), purpose="batch")
    with pytest.raises(openai.APIStatusError) as e:
        c.files.create(file=("c.jsonl", io.BytesIO(b"x" * 900_000)), purpose="batch")
    assert e.value.status_code == 507 and e.value.body["code"] == "store_full"
    assert c.files.content(kept.id).content == b"x" * 900_000
    assert len(box.files_on_disk()) == 2
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("d.jsonl", io.BytesIO(b"x")), purpose="nonsense")
    # an id that names another hub: that hub's, which this one cannot reach
    r = httpx.get(f"{box.hub.url}/v1/files/file-hub-b-{'0' * 24}", timeout=10,
                  headers={"authorization": "Bearer ka"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "held_elsewhere"
    assert r.headers["retry-after"] == "10"


def test_no_store_answers_501(procs):
    hub = Fleet(procs=procs).start_hub({}, metrics=False)
    r = httpx.get(hub.url + "/v1/files", timeout=10)
    assert r.status_code == 501 and r.json()["error"]["code"] == "store_disabled"
    r = httpx.get(hub.url + "/v1/messages/batches", timeout=10)
    assert r.status_code == 501 and r.json()["type"] == "error"


def test_a_full_disk_fails_the_upload_and_keeps_every_earlier_object(procs, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs",
                                            str(small)], capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a 3 MiB tmpfs")
    try:
        box = Box(procs, tmp_path, {"Store__Path": str(small / "store.db")})
        c = box.oai()
        kept = c.files.create(file=("a.jsonl", io.BytesIO(b"a" * 1_000_000)), purpose="batch")
        with pytest.raises(openai.APIStatusError) as e:
            c.files.create(file=("b.jsonl", io.BytesIO(b"b" * 2_500_000)), purpose="batch")
        assert e.value.status_code == 507 and e.value.body["code"] == "store_full"
        assert "disk" in e.value.body["message"]
        assert c.files.content(kept.id).content == b"a" * 1_000_000
        assert os.listdir(small / "files") == [kept.id]  # nothing left of the refused one
        again = c.files.create(file=("c.jsonl", io.BytesIO(b"c" * 100)), purpose="batch")
        assert {f.id for f in c.files.list()} == {kept.id, again.id}
    finally:
        procs.close()
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_anonymous_mode_is_one_owner(procs, tmp_path):
    box = Box(procs, tmp_path, keys=False)
    one, other = box.oai("anything"), box.oai("something-else")
    f = one.files.create(file=("a.jsonl", io.BytesIO(b"{}")), purpose="batch")
    assert other.files.retrieve(f.id).id == f.id  # no keys: every caller is `anonymous`
    conv = one.conversations.create()
    assert other.conversations.retrieve(conv.id).id == conv.id
