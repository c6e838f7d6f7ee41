"""The admin API against a real Control (fake node calls), and `appliance ctl` over it."""

from __future__ import annotations

import io
import json
import urllib.parse
from dataclasses import dataclass, field

import httpx
import pytest

from appliance import ctl
from appliance.http.errors import ApiError
from appliance.hub.api import admin
from appliance.hub.decide.affinity import Affinity
from appliance.hub.decide.control import Control
from appliance.hub.decide.cost import CostRouter
from appliance.hub.fleet.nodes import Registry
from tests.hub.decide.test_control import KEV_ERROR, FakeAudit, make


async def call(hub, method: str, raw_path: str) -> tuple[int, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": method, "path": urllib.parse.unquote(raw_path),
             "raw_path": raw_path.encode(), "headers": []}
    await admin.handle(hub, scope, receive, send)
    return sent[0]["status"], json.loads(sent[1]["body"])


@dataclass
class AdminAdmission:
    """What admin.handle reads of admission: the affinity counts per model, the cost's
    predicted waits and home waits."""
    affinity: Affinity = field(default_factory=Affinity)
    cost: CostRouter = field(default_factory=lambda: CostRouter(10.0))


@dataclass
class AdminHub:
    """What admin.handle reads of a Hub: its registry, control, audit and admission's
    affinity (no cluster)."""
    registry: Registry
    control: Control
    audit: FakeAudit
    cluster: None = None
    admission: AdminAdmission = field(default_factory=AdminAdmission)


async def fleet(nursery):
    control, registry, ops, audit, _ = make(
        [{"Name": "qwen/small:1b"}, {"Name": "kev-0.5b"}, {"Name": "phi-4", "MemoryMb": 9800}],
        {"gpu-a": (8000, {"qwen/small:1b": 500, "kev-0.5b": 300, "phi-4": 100}),
         "gpu-b": (4000, {"qwen/small:1b": 500, "kev-0.5b": 300, "phi-4": 100})},
        Models__ParkAfterFailures=2)
    ops.fail["kev-0.5b"] = KEV_ERROR
    await nursery.start(control.run)
    return AdminHub(registry, control, audit), ops


async def test_status_counts_what_each_model_should_have_now(nursery, autojump_clock):
    hub, ops = await fleet(nursery)
    code, body = await call(hub, "GET", "/admin/status")
    assert code == 200 and body["satisfied"] and body["problems"] == []  # nothing asked for yet
    await hub.control.activate("qwen/small:1b")
    for model in ("kev-0.5b", "phi-4"):
        with pytest.raises(ApiError):
            await hub.control.activate(model)
    code, body = await call(hub, "GET", "/admin/status")
    assert not body["satisfied"]
    by = {m["name"]: m for m in body["models"]}
    assert by["qwen/small:1b"]["satisfied"] and by["qwen/small:1b"]["ready"] == 1
    assert by["kev-0.5b"][
        "parked"] and by["kev-0.5b"]["last_error"] == KEV_ERROR and not by["kev-0.5b"]["satisfied"]
    # Asked for and fitted nowhere: unsatisfied, not "0 of 0".
    assert by[
        "phi-4"]["desired"] == 1 and by["phi-4"]["unplaceable"] and not by["phi-4"]["satisfied"]
    assert len(body["problems"]) == 2
    assert any("needs 9800 MiB; the most free is" in p for p in body["problems"])
    assert any(KEV_ERROR in p and "ctl retry kev-0.5b" in p for p in body["problems"])
    assert [n["name"] for n in body["nodes"]] == ["gpu-a", "gpu-b"]
    assert body["nodes"][0]["engines"] == [{"kind": "sim", "version": "0.1"}]
    _, models = await call(hub, "GET", "/admin/models")
    assert [m["name"] for m in models["models"]] == ["kev-0.5b", "phi-4", "qwen/small:1b"]
    _, nodes = await call(hub, "GET", "/admin/nodes")
    assert nodes[
        "nodes"][0]["models"]["ready"] == ["qwen/small:1b"] or nodes["nodes"][1]["models"]["ready"]


async def test_retry_cordon_pause_and_errors(nursery, autojump_clock):
    hub, ops = await fleet(nursery)
    with pytest.raises(ApiError):
        await hub.control.activate("kev-0.5b")
    code, body = await call(hub, "POST", "/admin/models/kev-0.5b/retry")
    assert code == 200 and body == {"model": "kev-0.5b", "retried": True, "was_parked": True}
    assert ("admin", {"actor": "admin", "action": "retry", "model": "kev-0.5b",
                      "was_parked": True}) in hub.audit.events
    code, body = await call(hub, "POST", "/admin/models/qwen%2Fsmall%3A1b/retry")
    assert code == 200 and body["model"] == "qwen/small:1b"
    code, _ = await call(hub, "POST",
                         "/admin/models/qwen/small:1b/retry")  # unencoded slash tolerated
    assert code == 200
    assert (await call(hub, "POST", "/admin/models/nope/retry"))[0] == 404
    assert (await call(hub, "GET", "/admin/models/kev-0.5b/retry"))[0] == 405
    code, body = await call(hub, "POST", "/admin/nodes/gpu-a/cordon")
    assert code == 200 and body["status"] == "cordoned" and hub.registry.nodes["gpu-a"].cordoned
    code, body = await call(hub, "POST", "/admin/nodes/gpu-a/uncordon")
    assert body["status"] == "up"
    code, body = await call(hub, "POST", "/admin/nodes/gpu-b/pause")
    assert code == 200 and ops.controls == [("gpu-b", "pause")] and body["status"] == "paused"
    await call(hub, "POST", "/admin/nodes/gpu-b/resume")
    assert ops.controls[-1] == ("gpu-b", "resume")
    assert (await call(hub, "POST", "/admin/nodes/gpu-x/pause"))[0] == 404
    assert (await call(hub, "GET", "/admin/nope"))[0] == 404
    assert (await call(hub, "POST", "/admin/status"))[0] == 405


def _client(routes: dict[tuple[str, str], tuple[int, dict]], seen: list) -> httpx.Client:
    def handler(req: httpx.Request) -> httpx.Response:
        seen.append((req.method, req.url.raw_path.decode(), req.headers.get("authorization")))
        code, body = routes[(req.method, req.url.raw_path.decode())]
        return httpx.Response(code, json=body)

    return httpx.Client(base_url="http://hub", transport=httpx.MockTransport(handler))


async def test_ctl_table_json_and_exit_codes(nursery, autojump_clock):
    hub, _ = await fleet(nursery)
    await hub.control.activate("qwen/small:1b")
    ok = admin.status(hub)
    for model in ("kev-0.5b", "phi-4"):
        with pytest.raises(ApiError):
            await hub.control.activate(model)
    bad = admin.status(hub)
    seen: list = []

    def run(argv, body):
        out, err = io.StringIO(), io.StringIO()
        code = ctl.run(argv, _client({("GET", "/admin/status"): (200, body),
                                      ("GET", "/admin/models"): (200, {"models": body["models"]}),
                                      ("GET", "/admin/nodes"): (200, {"nodes": body["nodes"]}),
                                      ("POST", "/admin/models/qwen%2Fsmall%3A1b/retry"):
                                          (200, {"model": "qwen/small:1b", "retried": True,
                                                 "was_parked": False}),
                                      ("POST", "/admin/nodes/gpu-z/cordon"): (404,
                                                                              {"error": "node "
                                                                                        "'gpu-z' "
                                                                                        "not found"})},
                                     seen), out, err)
        return code, out.getvalue(), err.getvalue()

    code, text, _ = run(["status"], ok)
    assert code == 0 and text.startswith("fleet: satisfied")
    code, text, _ = run(["status"], bad)
    assert code == 1 and text.startswith("fleet: NOT SATISFIED (2 problems)")
    lines = {line.split()[0]: line for line in text.splitlines() if line
             and not line.startswith((" ", "fleet"))}
    assert lines["MODEL"].split() == ["MODEL", "DESIRED", "READY", "LOADING", "FAILS", "STATE",
                                      "NODES", "PLACED", "CACHED", "HOME", "WAITS", "WHY"]
    assert "qwen/small:1b wait 0ms" in text  # LOAD: the predicted wait for a place there
    assert lines["kev-0.5b"].split()[1:6] == ["1", "0", "0", "2",
                                              "PARKED"] and KEV_ERROR in lines["kev-0.5b"]
    assert lines["phi-4"].split()[1:6] == ["1", "0", "0", "0", "UNPLACEABLE"]
    assert "needs 9800 MiB; the most free is" in lines["phi-4"]
    assert lines["qwen/small:1b"].split()[1:4] == ["1", "1",
                                                   "0"] and " ok " in lines["qwen/small:1b"]
    assert lines["NODE"].split()[:3] == ["NODE", "STATUS",
                                         "ENGINES"] and "sim 0.1" in lines["gpu-a"]
    code, text, _ = run(["--json", "status"], bad)
    assert code == 1 and json.loads(text) == bad
    code, text, _ = run(["models"], bad)
    assert code == 0 and "PARKED" in text
    code, text, _ = run(["--json", "nodes"], bad)
    assert code == 0 and [n["name"] for n in json.loads(text)["nodes"]] == ["gpu-a", "gpu-b"]
    code, text, _ = run(["retry", "qwen/small:1b"], bad)
    assert code == 0 and text.strip() == "qwen/small:1b: trying again"
    code, _, err = run(["cordon", "gpu-z"], bad)
    assert code == 1 and "404" in err and "gpu-z" in err
    assert run(["frobnicate"], bad)[0] == 2


def test_ctl_unreachable_hub_is_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("APPLIANCE_HUB_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("APPLIANCE_ADMIN_KEY", "k")
    assert ctl.main(["status"]) == 2
    assert "cannot reach the hub at http://127.0.0.1:9" in capsys.readouterr().err


def test_ctl_sends_the_admin_key(monkeypatch):
    seen: list = []
    monkeypatch.setenv("APPLIANCE_ADMIN_KEY", "s3cret")
    real = httpx.Client

    def fake_client(**kw):
        return real(transport=httpx.MockTransport(
            lambda req: (seen.append(req.headers.get("authorization")), httpx.Response(200, json={
                "satisfied": True, "problems": [], "models": [], "nodes": []}))[1]), **kw)

    monkeypatch.setattr(ctl.httpx, "Client", fake_client)
    assert ctl.main(["status"]) == 0 and seen == ["Bearer s3cret"]


async def test_forget_drops_a_node_and_ctl_forget_calls_delete(nursery, autojump_clock):
    hub, _ = await fleet(nursery)
    code, body = await call(hub, "DELETE", "/admin/nodes/gpu-b")
    assert code == 200 and body["action"] == "forget"
    assert "gpu-b" not in hub.registry.nodes
    forgets = [fields for kind, fields in hub.audit.events if kind == "admin"
               and fields["action"] == "forget"]
    assert len(
        forgets) == 1 and forgets[0]["node"] == "gpu-b" and forgets[0]["url"] == "http://gpu-b:9090"
    assert (await call(hub, "DELETE", "/admin/nodes/gpu-b"))[0] == 404
    assert (await call(hub, "GET", "/admin/nodes/gpu-a"))[0] == 405
    seen: list = []
    out, err = io.StringIO(), io.StringIO()
    client = _client({("DELETE", "/admin/nodes/gpu-a"): (200, {"node": "gpu-a", "action": "forget",
                                                               "status": "forgotten"})},
                     seen)
    assert ctl.run(["forget", "gpu-a"], client, out, err) == 0
    assert seen[0][:2] == ("DELETE",
                           "/admin/nodes/gpu-a") and out.getvalue().strip() == "gpu-a: forgotten"


_REAL_CLIENT = httpx.Client


def _key_seen(monkeypatch, argv) -> tuple[list, str]:
    seen: list = []
    real = _REAL_CLIENT

    def fake_client(**kw):
        return real(transport=httpx.MockTransport(
            lambda req: (seen.append(req.headers.get("authorization")), httpx.Response(200, json={
                "satisfied": True, "problems": [], "models": [], "nodes": []}))[1]), **kw)

    monkeypatch.setattr(ctl.httpx, "Client", fake_client)
    err = io.StringIO()
    assert ctl.run(argv, None, io.StringIO(), err) == 0
    return seen, err.getvalue()


def test_ctl_key_file_env_and_a_warning_for_key_on_the_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("APPLIANCE_ADMIN_KEY", "from-env")
    keyfile = tmp_path / "admin.key"
    keyfile.write_text("from-file\n")
    seen, err = _key_seen(monkeypatch, ["--key-file", str(keyfile), "status"])
    assert seen == ["Bearer from-file"] and err == ""
    seen, err = _key_seen(monkeypatch, ["status"])
    assert seen == ["Bearer from-env"] and err == ""
    seen, err = _key_seen(monkeypatch, ["--key", "argv-key", "status"])
    assert seen == ["Bearer argv-key"] and "process list" in err
    assert ctl.run(["--key-file", str(tmp_path / "missing"), "status"], None, io.StringIO(),
                   io.StringIO()) == 2


def test_ctl_options_before_or_after_the_subcommand(monkeypatch, capsys):
    seen: list = []
    real = httpx.Client
    monkeypatch.delenv("APPLIANCE_ADMIN_KEY", raising=False)

    def fake_client(**kw):
        return real(transport=httpx.MockTransport(
            lambda req: (seen.append((str(req.url), req.headers.get("authorization"))),
                         httpx.Response(200, json={
                "satisfied": True, "problems": [], "models": [], "nodes": []}))[1]), **kw)

    monkeypatch.setattr(ctl.httpx, "Client", fake_client)
    for argv in (["status", "--json"], ["--json", "status"],
                 ["status", "--json", "--url", "http://h:1", "--key", "k"],
                 ["--url", "http://h:1", "status", "--json", "--key", "k"]):
        capsys.readouterr()
        assert ctl.main(argv) == 0, argv
        assert json.loads(capsys.readouterr().out)["satisfied"] is True, argv  # --json honoured
    assert seen[2] == ("http://h:1/admin/status", "Bearer k") and seen[3] == seen[2]
    # Given before, not reset by the subcommand's copy of the option.
    assert ctl._parser().parse_args(["--url", "http://x:2", "status"]).url == "http://x:2"


def test_ctl_rm_exits_1_naming_each_node_that_failed_the_delete():
    """The hub's 200 says where it deleted and how each node answered: a node that failed
    (not "deleted" nor "not found") may still hold the model, so ctl names it and exits 1."""
    seen: list = []
    partial = {"deleted": ["gpu-a"], "nodes": {"gpu-a": "deleted", "gpu-b": "not found",
                                               "gpu-c": "ollama answered 500: disk busy"}}
    routes = {("DELETE", "/api/delete"): (200, partial),
              ("DELETE", "/api/delete?node=gpu-a"): (200, {"deleted": ["gpu-a"],
                                                           "nodes": {"gpu-a": "deleted"}})}
    out, err = io.StringIO(), io.StringIO()
    assert ctl.run(["rm", "qwen/small:1b"], client=_client(routes, seen), out=out, err=err) == 1
    assert out.getvalue() == "qwen/small:1b: deleted on gpu-a\n"
    assert err.getvalue() == "appliance ctl rm: gpu-c: ollama answered 500: disk busy\n"
    # Every node deleted it or never had it: exit 0, nothing on stderr.
    out, err = io.StringIO(), io.StringIO()
    assert ctl.run(["rm", "qwen/small:1b", "--node", "gpu-a"], client=_client(routes, seen),
                   out=out, err=err) == 0
    assert err.getvalue() == "" and "deleted on gpu-a" in out.getvalue()
    assert [s[:2] for s in seen] == [("DELETE", "/api/delete"),
                                     ("DELETE", "/api/delete?node=gpu-a")]
