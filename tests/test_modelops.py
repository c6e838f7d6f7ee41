"""`/api/pull` across the fleet (appliance/hub/modelops.py): nodes pull at once, at most
PULL_PARALLEL of them, their progress lines interleaved whole, the outcome per node."""

from __future__ import annotations

import json

import trio

from appliance.hub import modelops
from appliance.upstream import UpstreamError


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


class Hub:
    def __init__(self, upstream: FakeUpstream) -> None:
        self.upstream = upstream


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
    names = [f"n{i}" for i in range(modelops.PULL_PARALLEL + 2)]
    _, lines, took = await run_pull(up, names)
    assert up.most == modelops.PULL_PARALLEL and took == 8.0  # two rounds of 4 s
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
