"""`/api/pull` and `/api/delete` across the fleet (appliance/hub/api/modelops.py): one fan-out
asks the nodes at once, at most NODES_AT_ONCE of them, pull progress lines interleaved
whole, each node's outcome named in the answer."""

from __future__ import annotations

import json

import trio

from appliance.client.upstream import UpstreamError
from appliance.hub.api import modelops


class FakeResponse:
    def __init__(self, status: int, lines: list[dict], pace: float, lose: bool) -> None:
        self.status_code = status
        self.lines = lines
        self.pace = pace
        self.lose = lose
        self.closed = False

    async def chunks(self):
        for obj in self.lines:
            await trio.sleep(self.pace)
            raw = json.dumps(obj).encode() + b"\n"
            yield raw[:5]  # a line in pieces: the hub joins them
            yield raw[5:]
        if self.lose:
            raise UpstreamError("connection reset")

    async def aclose(self) -> None:
        self.closed = True


class FakeUpstream:
    """Each node's pull: three progress lines and its own success, a second apart
    (or, for the nodes named in `fail` / `lose`, an error line / a broken connection)."""

    def __init__(self, fail=(), lose=()) -> None:
        self.fail, self.lose = set(fail), set(lose)
        self.active = self.most = 0
        self.responses: list[FakeResponse] = []

    async def request(self, method, url, headers, body, read_timeout):
        node = url.split("//")[1].split("/")[0]
        assert url.endswith("/node/v1/pull") and json.loads(body) == {"model": "m"}
        lines = [{"status": f"pulling {i}", "total": 3, "completed": i} for i in (1, 2, 3)]
        lines.append({"error": "manifest unknown"} if node in self.fail else {"status": "success"})
        self.active += 1
        self.most = max(self.most, self.active)
        resp = Tracked(self, 200, lines, 1.0, node in self.lose)
        self.responses.append(resp)
        return resp


class Tracked(FakeResponse):
    def __init__(self, up: FakeUpstream, *a) -> None:
        super().__init__(*a)
        self.up = up

    async def aclose(self) -> None:
        if not self.closed:
            self.up.active -= 1
        self.closed = True


class Node:
    def __init__(self, name: str) -> None:
        self.name = name
        self.url = f"http://{name}"
        self.auth_raw = [(b"authorization", b"Bearer t")]


class Control:
    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget(self, model: str) -> None:
        self.forgotten.append(model)


class Hub:
    def __init__(self, upstream) -> None:
        self.upstream = upstream
        self.control = Control()


async def run_pull(up: FakeUpstream, names: list[str], stream: bool = True):
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    t0 = trio.current_time()
    await modelops._pull(Hub(up), send, "m", [Node(n) for n in names],  # type: ignore[arg-type]
                         b'{"model":"m"}', stream)
    took = trio.current_time() - t0
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert not bodies[-1].get("more_body") and all(m["more_body"] for m in bodies[:-1])
    lines = [json.loads(x) for m in bodies for x in m["body"].splitlines()]
    return sent, lines, took


async def test_two_nodes_pull_at_once_lines_interleaved_whole(autojump_clock):
    up = FakeUpstream()
    sent, lines, took = await run_pull(up, ["a", "b"])
    assert sent[0]["status"] == 200 and took == 4.0  # side by side, not 8 s one after the other
    progress = lines[:-1]
    assert {x["node"] for x in progress[:2]} == {"a", "b"}  # interleaved as they come
    for n in ("a", "b"):
        assert [x["completed"] for x in progress if x["node"] == n] == [1, 2, 3]
    assert lines[-1] == {"status": "success", "nodes": {"a": "success", "b": "success"}}
    assert all(r.closed for r in up.responses)


async def test_at_most_pull_parallel_nodes_at_once(autojump_clock):
    up = FakeUpstream()
    names = [f"n{i}" for i in range(modelops.NODES_AT_ONCE + 2)]
    _, lines, took = await run_pull(up, names)
    assert up.most == modelops.NODES_AT_ONCE and took == 8.0  # two rounds of 4 s
    assert list(lines[-1]["nodes"]) == names and lines[-1]["status"] == "success"


async def test_a_failed_node_is_named_and_the_others_still_succeed(autojump_clock):
    up = FakeUpstream(fail={"b"}, lose={"c"})
    _, lines, _ = await run_pull(up, ["a", "b", "c"])
    errors = {x["node"]: x["error"] for x in lines[:-1] if "error" in x}
    assert errors["b"] == "manifest unknown" and "node lost" in errors["c"]
    last = lines[-1]
    assert last["error"] == "pull of m failed on b, c" and "status" not in last
    assert last["nodes"]["a"] == "success" and last["nodes"]["b"] == "manifest unknown"
    assert "connection reset" in last["nodes"]["c"]
    # Not streamed: one answer at the end, 502 when a node failed.
    sent, _, _ = await run_pull(FakeUpstream(fail={"b"}), ["a", "b"], stream=False)
    assert sent[0]["status"] == 502
    body = json.loads(b"".join(m["body"] for m in sent if m["type"] == "http.response.body"))
    assert body["nodes"] == {"a": "success", "b": "manifest unknown"}


class DeleteResponse:
    def __init__(self, up: DeleteUpstream, status: int) -> None:
        self.up, self.status_code, self.closed = up, status, False

    async def read(self) -> bytes:
        return b""

    async def aclose(self) -> None:
        if not self.closed:
            self.up.active -= 1
        self.closed = True


class DeleteUpstream:
    """Each node answers its delete after a second: 200 when it `has` the model, 404 when
    not, 500 for `fail`; `lose` breaks the connection, `hang` never answers."""

    def __init__(self, has=(), fail=(), lose=(), hang=()) -> None:
        self.has, self.fail, self.lose, self.hang = set(has), set(fail), set(lose), set(hang)
        self.active = self.most = 0
        self.asked: list[str] = []
        self.responses: list[DeleteResponse] = []

    async def request(self, method, url, headers, body, read_timeout):
        node = url.split("//")[1].split("/")[0]
        assert method == "POST" and url.endswith("/node/v1/delete")
        assert json.loads(body) == {"model": "m"}
        self.asked.append(node)
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            await trio.sleep(1.0)
            if node in self.hang:
                await trio.sleep_forever()
            if node in self.lose:
                raise UpstreamError("connection reset")
        except BaseException:
            self.active -= 1
            raise
        resp = DeleteResponse(self, 500 if node in self.fail else 200 if node in self.has else 404)
        self.responses.append(resp)
        return resp


async def run_delete(up: DeleteUpstream, names: list[str]):
    sent: list[dict] = []

    async def send(msg: dict) -> None:
        sent.append(msg)

    hub = Hub(up)
    t0 = trio.current_time()
    await modelops._delete(hub, send, "m", [Node(n) for n in names],  # type: ignore[arg-type]
                           b'{"model":"m"}')
    took = trio.current_time() - t0
    body = json.loads(b"".join(m["body"] for m in sent if m["type"] == "http.response.body"))
    return sent[0]["status"], body, took, hub


async def test_delete_asks_nodes_at_once_bounded_and_names_each_outcome(autojump_clock):
    names = [f"n{i}" for i in range(modelops.NODES_AT_ONCE + 2)]
    up = DeleteUpstream(has={"n0", "n5"})
    status, body, took, hub = await run_delete(up, names)
    assert up.most == modelops.NODES_AT_ONCE and took == 2.0  # two rounds of 1 s, not 6 s
    assert status == 200 and body["deleted"] == ["n0", "n5"]  # in the order asked
    assert list(body["nodes"]) == names
    assert body["nodes"]["n0"] == "deleted" and body["nodes"]["n1"] == "not found"
    assert hub.control.forgotten == ["m"]
    assert up.active == 0 and all(r.closed for r in up.responses)


async def test_delete_names_a_failed_and_a_lost_node(autojump_clock):
    up = DeleteUpstream(has={"a"}, fail={"b"}, lose={"c"}, hang={"d"})
    status, body, took, hub = await run_delete(up, ["a", "b", "c", "d"])
    assert status == 200 and body["deleted"] == ["a"]
    assert took == modelops.DELETE_SECONDS  # the silent node is bounded, the others side by side
    nodes = body["nodes"]
    assert nodes["a"] == "deleted" and nodes["b"] == "node answered 500"
    assert "node lost" in nodes["c"] and "connection reset" in nodes["c"]
    assert nodes["d"] == f"no answer in {modelops.DELETE_SECONDS:g} s"
    assert up.active == 0
    # No node had it but one failed: not a plain 404 (that node may still hold the model).
    status, body, _, hub = await run_delete(DeleteUpstream(lose={"b"}), ["a", "b"])
    assert status == 502 and body["error"] == "delete of m failed on b"
    assert body["nodes"]["a"] == "not found" and hub.control.forgotten == []
    # None had it: Ollama's 404.
    status, body, _, _ = await run_delete(DeleteUpstream(), ["a", "b"])
    assert status == 404 and body["error"] == "model 'm' not found"
    assert body["nodes"] == {"a": "not found", "b": "not found"}
