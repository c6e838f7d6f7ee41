"""The `llamacpp` engine: one llama.cpp server process per loaded model.

Theory of operation: `load(model, source, args)` starts `Engine__Command` -- a template
split like a shell line (shlex), where `{model}` is the catalog's source (else the model
name), `{port}` a free loopback port and `{args}` the profile's arguments (spliced in as
separate words) -- and returns once the server answers: `GET /health` is 200 (llama-server;
503 means still loading) or, for servers without it (`python -m llama_cpp.server` binds only
after the model is loaded), `GET /v1/models` is 200. Both of these start:

    llama-server -m {model} --port {port} {args}
    /opt/venv/bin/python -m llama_cpp.server --model {model} --host 127.0.0.1 --port {port} {args}

The word `python` is run as found on PATH: give the full interpreter path of the
environment where llama-cpp-python is installed. Wrapper scripts should `exec` the server.
Which of the two serves a model (its `dialect`, engines/params.py: llama-cpp-python takes
neither `max_completion_tokens` nor `json_schema`) is known from the command
(`-m llama_cpp.server`) or, behind a wrapper, from its missing `/health`.

It owns the processes, never their time bound: load() polls until ready or until the
process exits; the node wraps it in `Engine__StartTimeoutSeconds`, and a cancelled load
stops the process. Each process's stdout and stderr are read continuously (the pipe never
fills) into a 64 KiB tail; when a start fails or a ready server dies, the last error is
llama.cpp's own line picked out of that tail (`pick_error`), not a Python traceback's.

Processes die with the node: each is a `childproc.Child` (own process group, parent-death
signal, forked from the trio thread). Unload and a cancelled run() send SIGTERM to the
group, then SIGKILL after `STOP_GRACE_SECONDS`; a SIGKILL of the node leaves it to the
kernel.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shlex
import shutil
import signal

import httpx
import trio

from appliance.config import Config
from appliance.node.engines.base import Changed, Engine, EngineError, unheard
from appliance.node.engines.childproc import Child, expand_command, free_port, with_alias
from appliance.node.engines.gguf import read_meta
from appliance.node.engines.llamaslots import engine_slots, watch_slots
from appliance.node.engines.params import LLAMA_CPP_PYTHON, OPENAI
from appliance.wire import EngineInstall, ModelMeta, ModelState, ModelStatus

log = logging.getLogger(__name__)

# 64 KiB of output: llama.cpp prints ~200 lines of model metadata before the error, and
# llama-cpp-python adds a 20-line traceback after it; this keeps both with room to spare.
TAIL_BYTES = 64 * 1024
# How often /health is asked while a model loads: loopback polls cost microseconds, and
# 100 ms is what this adds, at most, to a start that takes seconds.
POLL_SECONDS = 0.1
# After a start fails: how long to wait for the rest of its output (EOF on the pipe).
DRAIN_SECONDS = 1.0
# llama-server stops in well under a second on SIGTERM; one that has not after 5 s is
# stuck (a driver call) and gets SIGKILL. The GPU memory is freed either way.
STOP_GRACE_SECONDS = 5.0
KILL_WAIT_SECONDS = 2.0
STOP_SECONDS = STOP_GRACE_SECONDS + KILL_WAIT_SECONDS + 1.0
# Per-request bound of the readiness poll (loopback; a server that accepts and then
# hangs for 2 s is polled again).
HEALTH_TIMEOUT = httpx.Timeout(2.0)
MiB = 1024 * 1024

# Lines of llama.cpp's own logging that say why a load failed, best first. The first
# pattern that matches any line wins; of its lines the last one before a traceback.
_ERROR_PATTERNS = [
    re.compile(p, re.I)
    for p in (
        r"unknown model architecture",
        r"error loading model",
        r"failed to open|no such file|permission denied|cannot open",
        r"GGML_ASSERT|out of memory|CUDA error",
        r"\berror\b",
        r"\bfailed\b|abort",
    )
]
_TRACEBACK = "Traceback (most recent call last):"


def pick_error(tail: str) -> str:
    """The line of an engine's output that best says why it failed ('' when empty)."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    before = lines
    tb_last = ""
    if _TRACEBACK in lines:
        i = lines.index(_TRACEBACK)
        before = lines[:i]
        after = [ln for ln in lines[i + 1 :] if not ln.startswith(("File ", "^", "~"))]
        tb_last = after[-1] if after else ""
    for pat in _ERROR_PATTERNS:
        hits = [ln for ln in before if pat.search(ln)]
        if hits:
            return hits[-1][:500]
    if tb_last:
        return tb_last[:500]
    return " | ".join(before[-3:])[:500]


def with_args(meta: ModelMeta | None, args: str) -> ModelMeta | None:
    """The file's capabilities plus what the server's arguments add: a vision projector
    (`--mmproj`), an embedding endpoint (`--embedding(s)`)."""
    if meta is None:
        return None
    words = shlex.split(args) if args else []
    caps = list(meta.capabilities or [])
    if any(w in ("--mmproj", "-mm", "--mmproj-url") for w in words) and "vision" not in caps:
        caps.append("vision")
    if any(w in ("--embedding", "--embeddings") for w in words) and "embedding" not in caps:
        caps.append("embedding")
    meta.capabilities = caps
    return meta


def props_capabilities(caps: list[str], props: dict[str, object]) -> list[str]:
    """`caps` as llama-server's /props corrects them: `modalities.vision` says vision, the
    chat template's caps say tools (with --jinja; without it the server calls none)."""
    out = list(caps)
    modalities = props.get("modalities")
    if isinstance(modalities, dict) and isinstance(modalities.get("vision"), bool):
        out = [c for c in out if c != "vision"] + (["vision"] if modalities["vision"] else [])
    tmpl = props.get("chat_template_caps")
    if isinstance(tmpl, dict) and isinstance(tmpl.get("supports_tools"), bool):
        tools = tmpl["supports_tools"] and tmpl.get("supports_tool_calls") is not False
        out = [c for c in out if c != "tools"] + (["tools"] if tools else [])
    return out


class _Model:
    def __init__(self, name: str, source: str, args: str,
                 meta: ModelMeta | None = None) -> None:
        self.name, self.source, self.args = name, source or name, args
        self.state: ModelStatus = "loading"
        self.last_error = ""
        self.port = 0
        self.child: Child | None = None
        self.tail = bytearray()
        self.scope = trio.CancelScope()
        self.exited = trio.Event()
        self.output_eof = trio.Event()
        self.settled = trio.Event()  # ready or failed: the load attempt is over
        self.stopped = trio.Event()  # the process is gone
        self.unloading = False
        self.started = False  # load() has returned: it served
        self.dialect = OPENAI  # llama-server; LLAMA_CPP_PYTHON once the server shows it is
        self.alias = ""  # the name we gave the server (with_alias): how it is told from another
        self.foreign = False  # another process answered on our port (said once in the log)
        try:
            self.size_mb = math.ceil(os.path.getsize(self.source) / MiB)
        except OSError:
            self.size_mb = 0
        self.meta = with_args(meta, args)
        self.slots: int | None = None  # the server's total_slots (/props), bounded
        self.busy: int | None = None  # its slots processing now (/slots)

    def error_text(self) -> str:
        return pick_error(self.tail.decode("utf-8", "replace"))


class LlamaCppEngine(Engine):
    kind = "llamacpp"
    restartable = True

    def __init__(self, cfg: Config, on_change: Changed = unheard) -> None:
        super().__init__(on_change)
        self.command = cfg.engine.command
        self._models: dict[str, _Model] = {}
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None
        self._installs: list[EngineInstall] = []
        self._children: set[Child] = set()

    # --- Engine ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._installs = await self._probe_install()
        # trust_env=False: loopback health checks must not go through an HTTP(S)_PROXY.
        async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT, trust_env=False) as client:
            self._client = client
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    task_status.started()
                    await trio.sleep_forever()
            finally:
                self._nursery = None
                for child in list(self._children):  # each model's task stopped its own: a net
                    child.signal(signal.SIGKILL)

    def installs(self) -> list[EngineInstall]:
        return list(self._installs)

    def models(self) -> list[ModelState]:
        return [ModelState(name=m.name, size_mb=m.size_mb, state=m.state, last_error=m.last_error,
                           meta=m.meta, slots=m.slots if m.state == "ready" else None,
                           busy=m.busy if m.state == "ready" else None)
                for m in self._models.values()]

    def upstream(self, model: str) -> str | None:
        m = self._models.get(model)
        if m is None or m.state != "ready":
            return None
        return f"http://127.0.0.1:{m.port}"

    def dialect(self, model: str) -> str:
        m = self._models.get(model)
        return m.dialect if m is not None else OPENAI

    def pid(self, model: str) -> int | None:
        """The engine process serving `model` (for diagnostics and tests)."""
        m = self._models.get(model)
        return m.child.pid if m and m.child and not m.stopped.is_set() else None

    async def load(self, model: str, source: str = "", args: str = "") -> None:
        if self._nursery is None:
            raise EngineError("the llamacpp engine is not running")
        old = self._models.get(model)
        if old is not None and not old.stopped.is_set():
            if old.state == "loading":
                await old.settled.wait()
            if old.state == "ready" and (old.source, old.args) == (source or model, args):
                return
            await self.unload(model)
        path = source or model
        meta = await trio.to_thread.run_sync(read_meta, path) if os.path.isfile(path) else None
        m = _Model(model, source, args, meta)
        self._models[model] = m
        self.on_change()
        await self._nursery.start(self._run_model, m)

    async def unload(self, model: str) -> None:
        m = self._models.get(model)
        if m is None:
            return
        if not m.stopped.is_set():
            m.unloading = True
            m.scope.cancel()
            await m.stopped.wait()  # bounded: the model's own cleanup is
        self.on_change()

    async def restart(self, model: str) -> None:
        """A hung server (node/probe.py): stopped -- SIGKILL past the grace, so a stopped
        process goes too -- and started again with the source and arguments it had."""
        m = self._models.get(model)
        if m is None:
            raise EngineError(f"{model} is not loaded here")
        source, args = m.source, m.args
        await self.unload(model)
        await self.load(model, source, args)

    # --- one model's process -----------------------------------------------------------

    async def _run_model(self, m: _Model, *,
                         task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with m.scope:
            try:
                m.port = free_port()
                bare = expand_command(self.command, m.source, m.port, m.args)
                argv = with_alias(bare, m.name)
                m.alias = m.name if argv != bare else ""
                if argv[1:3] == ["-m", "llama_cpp.server"]:
                    m.dialect = LLAMA_CPP_PYTHON
                try:
                    m.child = Child(argv)
                except (OSError, IndexError) as e:
                    what = argv[0] if argv else "(empty Engine__Command)"
                    m.last_error = f"cannot start {what}: {e}"
                    m.state = "failed"
                else:
                    log.info("llamacpp: pid %d serves %s on port %d: %s", m.child.pid, m.name,
                             m.port, shlex.join(argv))
                    await self._serve(m, task_status)
            finally:
                if m.state == "loading" and m.unloading:
                    m.last_error, m.state = "unloaded before it was ready", "available"
                elif m.state == "loading":  # cancelled by the caller: the start timeout
                    err = m.error_text()
                    m.last_error = "not ready when the start was cancelled (start timeout?)" + (
                        f"; last output: {err}" if err else "")
                    m.state = "failed"
                elif m.state == "ready":  # unloaded, or the engine is shutting down
                    m.state = "available"
                with trio.move_on_after(STOP_SECONDS, shield=True):
                    await self._stop(m)
                if m.child is not None:
                    self._children.discard(m.child)
                m.settled.set()
                m.stopped.set()
                self.on_change()
        if not m.started:  # a cancel from the caller has propagated above; this is our own
            raise EngineError(m.last_error)

    async def _serve(self, m: _Model, task_status: trio.TaskStatus[None]) -> None:
        """Watch one started process: ready (task_status.started) or failed, until it exits."""
        assert m.child is not None
        self._children.add(m.child)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, m)
            nursery.start_soon(self._watch_exit, m)
            if await self._wait_ready(m):
                await self._read_props(m)
                m.state = "ready"
                m.settled.set()
                self.on_change()
                m.started = True
                task_status.started()
                nursery.start_soon(self._watch_slots, m)
                await m.exited.wait()
            with trio.move_on_after(DRAIN_SECONDS):
                await m.output_eof.wait()
            nursery.cancel_scope.cancel()
        code = m.child.returncode
        m.last_error = m.error_text() or f"the engine exited with code {code}"
        m.state = "failed"
        log.warning("llamacpp: %s exited with code %s: %s", m.name, code, m.last_error)

    async def _wait_ready(self, m: _Model) -> bool:
        """Poll until the server answers (True) or the process exits (False)."""
        assert self._client is not None
        base = f"http://127.0.0.1:{m.port}"
        paths = ["/health", "/v1/models"]
        while not m.exited.is_set():
            try:
                r = await self._client.get(base + paths[0])
                if r.status_code == 200 and await self._ours(m, base, r):
                    return True
                if r.status_code == 404 and len(paths) > 1:
                    paths.pop(0)  # no /health here (llama_cpp.server): ask /v1/models
                    m.dialect = LLAMA_CPP_PYTHON
                    continue
            except httpx.TransportError:
                pass
            with trio.move_on_after(POLL_SECONDS):
                await m.exited.wait()
        return False

    async def _ours(self, m: _Model, base: str, r: httpx.Response) -> bool:
        """Whether the server that answered on the port is the one we started: another
        process can take a free port between our pick and the child's bind (a busy box),
        and its /health would pass for ours -- a model served by the wrong server. A
        server we named (with_alias) must list that name in /v1/models; else it is not
        ours, and the wait goes on until ours answers or exits with its own error."""
        if not m.alias:
            return True
        assert self._client is not None
        if not r.url.path.endswith("/v1/models"):
            r = await self._client.get(base + "/v1/models")
        try:
            ids = [d.get("id") for d in r.json().get("data", [])[:64] if isinstance(d, dict)]
        except (ValueError, AttributeError):
            ids = []
        if r.status_code == 200 and m.alias in ids:
            return True
        if not m.foreign:
            m.foreign = True
            log.warning("llamacpp: port %d answers, but not as %s: another process holds it",
                        m.port, m.alias)
        return False

    async def _read_props(self, m: _Model) -> None:
        """What the running server says the model can do (llama-server's /props: its
        modalities and its chat template's caps) over what the file said; a server
        without /props (llama_cpp.server) keeps the file's word."""
        assert self._client is not None
        try:
            r = await self._client.get(f"http://127.0.0.1:{m.port}/props")
            props = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            props = None
        if isinstance(props, dict) and m.meta is not None:
            m.meta.capabilities = props_capabilities(m.meta.capabilities or [], props)
        if isinstance(props, dict):
            m.slots = engine_slots(props.get("total_slots"), m.name)

    async def _watch_slots(self, m: _Model) -> None:
        assert self._client is not None
        await watch_slots(self._client, f"http://127.0.0.1:{m.port}/slots", m, self.on_change)

    async def _watch_exit(self, m: _Model) -> None:
        assert m.child is not None
        await m.child.wait()
        m.exited.set()

    async def _pump(self, m: _Model) -> None:
        """Read the process's output as it comes, keeping the last TAIL_BYTES."""
        assert m.child is not None
        try:
            while chunk := await m.child.output.receive_some(65536):
                m.tail += chunk
                if len(m.tail) > 2 * TAIL_BYTES:
                    del m.tail[:-TAIL_BYTES]
        except trio.ClosedResourceError:
            pass
        finally:
            del m.tail[:-TAIL_BYTES]
            m.output_eof.set()

    async def _stop(self, m: _Model) -> None:
        child = m.child
        if child is None:
            return
        try:
            if child.returncode is None:
                child.signal(signal.SIGTERM)
                with trio.move_on_after(STOP_GRACE_SECONDS):
                    await child.wait()
            if child.returncode is None:
                child.signal(signal.SIGKILL)
                with trio.move_on_after(KILL_WAIT_SECONDS):
                    await child.wait()
        finally:
            await child.output.aclose()

    async def _probe_install(self) -> list[EngineInstall]:
        """Is the command there, and which version (best effort, bounded)?"""
        argv = expand_command(self.command, "x", 0, "")
        if not argv or shutil.which(argv[0]) is None:
            log.warning("llamacpp: Engine__Command %r: %r not found; this node serves no models",
                        self.command, argv[0] if argv else "")
            return []
        if argv[1:3] == ["-m", "llama_cpp.server"]:
            probe = [argv[0], "-c",
                     "import importlib.metadata as m; print(m.version('llama_cpp_python'))"]
        else:
            probe = [argv[0], "--version"]
        version = ""
        with trio.move_on_after(10):
            try:
                done = await trio.run_process(probe, capture_stdout=True, capture_stderr=True,
                                              check=False)
                out = (done.stdout + done.stderr).decode("utf-8", "replace")
                found = re.search(r"version:\s*(\S+)", out) or re.match(r"\s*(\d+\.\d+\S*)\s*$",
                                                                        out)
                version = found.group(1) if found else ""
            except OSError:
                pass
        return [EngineInstall(kind="llamacpp", version=version)]
