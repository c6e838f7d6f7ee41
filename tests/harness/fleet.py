"""One fleet of real processes for every end-to-end test: hubs, nodes and stand-alone
engines (`appliance sim`), started as an operator would on ports the OS picks
(tests/harness/procs.py), asked over HTTP, stopped by pid.

    fleet = Fleet(tmp_path, admin=ADMIN)            # owns its Procs; fleet.close() kills all
    fleet.start_hub({"Audit__Path": fleet.audit_path, ...})
    fleet.start_node("gpu-a", {"Sim__Models__0__Name": "sim-small"})   # Hub__Url, token added
    fleet.wait_up("gpu-a")
    r = fleet.chat("sim-small", key=KEY, max_tokens=3)          # an httpx.Response
    fleet.status(); fleet.nodes(); fleet.models(); fleet.audit("request"); fleet.metric(...)
    fleet.start("up", env, wait=("hub", "node")); fleet.run("hub", env)  # one that exits

The fleet adds to each process only what joins it to the others (a node's `Hub__Url` and
`Auth__NodeToken`, the hub's `Auth__NodeToken` and `Auth__AdminKey`); every other setting
is the test's own, so what a test sets is what its processes run with. Module-scoped
fixtures build one with `Fleet(tmp_path_factory.mktemp(...))` and `close()` it; a test
with the `procs` fixture passes `Fleet(tmp_path, procs=procs)`. tests/e2e starts
processes only through here (tests/test_tests_layout.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.harness.procs import Proc, Procs, clean_env, wait_until

TOKEN = "node-secret"


def chat_body(model: str, content: str = "hi", **fields: Any) -> dict[str, Any]:
    """An OpenAI chat request's body: one user message; `fields` add or replace."""
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


class Fleet:
    def __init__(self, tmp: Path | None = None, *, procs: Procs | None = None,
                 token: str | None = TOKEN, admin: str | None = None,
                 key: str | None = None, verify: Any = True) -> None:
        self.tmp = tmp
        self.procs = procs if procs is not None else Procs()
        self.token, self.admin_key, self.verify = token, admin, verify
        self.key = key  # the client key chat() and post() send when given none
        self.hubs: dict[str, Proc] = {}
        self.node_procs: dict[str, Proc] = {}
        self.sims: list[Proc] = []
        self._admin: httpx.Client | None = None

    # --- starting and stopping ---------------------------------------------------------

    @property
    def audit_path(self) -> str:
        """Where a test that wants an audit file points `Audit__Path`."""
        assert self.tmp is not None, "Fleet(tmp) for an audit file"
        return str(self.tmp / "audit.jsonl")

    def start_hub(self, env: dict[str, str] | None = None, *, name: str = "hub",
                  metrics: bool = True, args: list[str] = ()) -> Proc:
        """A hub (Procs.hub: its listener on port 0, metrics on port 0 unless `metrics`
        is off); the first one started is `fleet.hub`."""
        e = {**({"Auth__NodeToken": self.token} if self.token else {}),
             **({"Auth__AdminKey": self.admin_key} if self.admin_key else {}), **(env or {})}
        p = self.procs.hub(e, metrics=metrics, args=args)
        self.hubs[name] = p
        return p

    def start_node(self, name: str, env: dict[str, str] | None = None, *,
                   hubs: list[str] | None = None, announce: bool = True,
                   args: list[str] = ()) -> Proc:
        """A node (Procs.node: sim engine unless the env says otherwise) announcing to the
        hub (or to each of `hubs`, by name); `announce=False` for a node the hub's
        `Nodes__N__Url` names instead (or one started before its hub)."""
        e = {"Auth__NodeToken": self.token} if self.token else {}
        if announce:
            e["Hub__Url"] = ",".join(self.hubs[h].url for h in hubs) if hubs else self.url
        p = self.procs.node(name, {**e, **(env or {})}, args)
        self.node_procs[name] = p
        return p

    def start_sim(self, env: dict[str, str] | None = None) -> Proc:
        """A stand-alone `appliance sim`, an engine for `Engine__Kind=openai|ollama` nodes."""
        p = self.procs.start("sim", {"Sim__Listen": "127.0.0.1:0", "Sim__TokensPerSecond": "0",
                                     **(env or {})})
        self.sims.append(p)
        return p

    def start(self, role: str, env: dict[str, str], *, args: list[str] = (),
              wait: tuple[str, ...] | None = None) -> Proc:
        """Any other `appliance ROLE` (`up`, a hub or node with every setting the test's
        own), ready when it says it listens on each of `wait` (default: ROLE)."""
        return self.procs.start(role, env, args, wait=wait)

    def run(self, role: str, env: dict[str, str], *, args: list[str] = (),
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """`appliance ROLE` expected to exit by itself (a start-up refusal): its exit code
        and whole output. A hub opens no store unless `env` names one."""
        base = {"Store__Path": ""} if role in ("hub", "up") else {}
        return subprocess.run([sys.executable, "-m", "appliance", role, *args],
                              capture_output=True, text=True, timeout=timeout,
                              env=clean_env({**base, **env}))

    def node(self, name: str) -> Proc:
        return self.node_procs[name]

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Signal one process by pid and wait for its exit code."""
        proc.signal(sig)
        return proc.wait_exit(timeout)

    def close(self) -> None:
        if self._admin is not None:
            self._admin.close()
        self.procs.close()

    # --- asking ------------------------------------------------------------------------

    @property
    def hub(self) -> Proc:
        return next(iter(self.hubs.values()))

    def hub_url(self, hub: str | None = None) -> str:
        return self.hubs[hub].url if hub else self.url

    @property
    def url(self) -> str:
        return self.hub.url

    @property
    def metrics_url(self) -> str:
        return self.hub.urls["metrics"]

    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    @property
    def admin(self) -> httpx.Client:
        """A kept client on the (first) hub with the admin key: `fleet.admin.post(...)`."""
        if self._admin is None:
            self._admin = httpx.Client(base_url=self.url, headers=self.admin_headers(),
                                       timeout=60, verify=self.verify)
        return self._admin

    def get(self, path: str, *, hub: str | None = None, timeout: float = 10) -> httpx.Response:
        """GET on the hub, with the admin key when the fleet has one."""
        return httpx.get(self.hub_url(hub) + path, headers=self.admin_headers(),
                         timeout=timeout, verify=self.verify)

    def status(self, hub: str | None = None) -> dict[str, Any]:
        return self.get("/api/status", hub=hub).json()

    def nodes(self, hub: str | None = None) -> dict[str, dict[str, Any]]:
        """The hub's rows of its nodes (/api/status), by name."""
        return {n["name"]: n for n in self.status(hub)["nodes"]}

    def admin_nodes(self) -> dict[str, dict[str, Any]]:
        """The hub's nodes as /admin/nodes lists them (forgotten ones gone), by name."""
        return {n["name"]: n for n in self.admin.get("/admin/nodes").json()["nodes"]}

    def up(self, hub: str | None = None) -> set[str]:
        return {name for name, n in self.nodes(hub).items() if n["status"] == "up"}

    def models(self, hub: str | None = None) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.status(hub)["models"]}

    def ready_on(self, model: str, hub: str | None = None) -> set[str]:
        """The nodes the hub says `model` is ready on."""
        m = self.models(hub).get(model)
        return set(m["nodes"]) if m else set()

    def post(self, path: str, body: dict[str, Any], *, key: str | None = None,
             hub: str | None = None, headers: dict[str, str] | None = None,
             timeout: float = 60) -> httpx.Response:
        """POST a JSON body to the hub as a client (with `key` as its bearer key)."""
        key = key or self.key
        h = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
        return httpx.post(self.hub_url(hub) + path, json=body, headers=h, timeout=timeout,
                          verify=self.verify)

    def chat(self, model: str, content: str = "hi", *, key: str | None = None,
             max_tokens: int | None = None, hub: str | None = None,
             path: str = "/v1/chat/completions", headers: dict[str, str] | None = None,
             timeout: float = 60, **body: Any) -> httpx.Response:
        """One chat completion (any route taking OpenAI's chat body with `path`), whole;
        `body` adds or replaces fields."""
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return self.post(path, chat_body(model, content, **body), key=key, hub=hub,
                         headers=headers, timeout=timeout)

    def answer(self, model: str, content: str = "hi", **kw: Any) -> dict[str, Any]:
        """chat(), asserted answered (200): the answer's JSON."""
        r = self.chat(model, content, **kw)
        assert r.status_code == 200, r.text
        return r.json()

    def openai(self, key: str = "anyone", timeout: float = 60, hub: str | None = None) -> Any:
        """The official `openai` client on the hub's /v1, retries off."""
        import openai

        return openai.OpenAI(base_url=self.hub_url(hub) + "/v1", api_key=key, max_retries=0,
                             timeout=timeout)

    def audit(self, kind: str | None = None, path: str | Path | None = None
              ) -> list[dict[str, Any]]:
        """The audit file's records (of one `kind`), in order; `path` another audit file."""
        lines = Path(path or self.audit_path).read_text().splitlines()
        return [x for x in map(json.loads, filter(str.strip, lines))
                if kind is None or x["kind"] == kind]

    def scrape(self, url: str | None = None) -> str:
        return httpx.get((url or self.metrics_url) + "/metrics", timeout=10,
                         verify=self.verify).text

    def metric(self, name: str, labels: str = "", url: str | None = None) -> float | None:
        """The sample `name{labels}` (labels as the scrape writes them), None if absent."""
        for line in self.scrape(url).splitlines():
            if line.startswith(name + labels + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def metric_sum(self, name: str, url: str | None = None) -> float:
        """The sum of every labelled sample of `name`."""
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$",
                                                 self.scrape(url), re.M))

    def loads(self, model: str) -> int:
        """Load attempts of `model` the nodes logged."""
        rx = re.compile(rf"loading {re.escape(model)} \(source")
        return sum(1 for p in self.node_procs.values() for line in list(p.stderr_lines)
                   if rx.search(line))

    def ctl(self, *args: str, hub: str | None = None) -> tuple[int, str]:
        """`appliance ctl ARGS` against the hub, with the admin key: (exit code, output)."""
        key = {"APPLIANCE_ADMIN_KEY": self.admin_key} if self.admin_key else {}
        r = self.run("ctl", {"APPLIANCE_HUB_URL": self.hub_url(hub), **key}, args=list(args))
        return r.returncode, r.stdout + r.stderr

    # --- waiting -----------------------------------------------------------------------

    def wait(self, fn: Callable[[], Any], what: str, timeout: float = 30) -> Any:
        return wait_until(fn, timeout=timeout, what=what)

    def wait_up(self, *names: str, hub: str | None = None, timeout: float = 30) -> None:
        """Until each named node is up on the hub."""
        self.wait(lambda: set(names) <= self.up(hub), f"{names} up", timeout)

    def wait_models(self, *models: str, hub: str | None = None, timeout: float = 30) -> None:
        """Until the hub knows each model."""
        self.wait(lambda: set(models) <= set(self.models(hub)), f"{models} known", timeout)
