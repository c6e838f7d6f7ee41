"""The PyInstaller executable, run as systemd would run it.

The binary is built once per test session by packaging/build.sh into
~/.cache/appliance/binary/<hash of the sources>/appliance and reused while the sources
are unchanged (a build takes ~40 s on two cores). Each test starts it from `/` with an
empty environment plus what it needs, a TMPDIR it chooses (onefile extraction happens
there), and a notify socket it binds, then stops it with SIGTERM to the bootloader's
pid, as `KillMode=mixed` does.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from appliance import __version__
from tests.harness import ROOT
from tests.harness.procfs import descendants
from tests.harness.procs import LISTEN_RE, kill_group, wait_until

pytestmark = pytest.mark.binary

CACHE = Path(os.environ.get("APPLIANCE_BINARY_CACHE",
                            Path.home() / ".cache" / "appliance" / "binary"))
# A cold onefile start extracts ~20 MB before Python runs; generous on a loaded box.
START_TIMEOUT = 60.0
DRAIN_SECONDS = 3


def source_hash() -> str:
    h = hashlib.sha256()
    files = sorted(p for p in (ROOT / "appliance").rglob("*.py") if p.name != "_build.py")
    files += sorted(
        (ROOT / "appliance" / "hub" / "api" / "ui" / "static").iterdir())  # the page's data files
    files += [ROOT / "pyproject.toml", ROOT / "packaging" / "appliance.spec",
              ROOT / "packaging" / "build.sh"]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def binary() -> Path:
    """Path of the built executable; built here when the sources changed."""
    return build_binary()


def build_binary() -> Path:
    """Build (or reuse) the executable for the current sources; bench/binary.py uses it too."""
    key = source_hash()
    exe = CACHE / key / "appliance"
    if exe.exists():
        return exe
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be building the same
        if exe.exists():
            return exe
        tmp = CACHE / f"{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        r = subprocess.run([str(ROOT / "packaging" / "build.sh"), str(tmp)], capture_output=True,
                           text=True,
                           timeout=1200)
        assert r.returncode == 0, f"build failed:\n{r.stdout}\n{r.stderr}"
        print(
            f"\nbinary built in {time.monotonic() - t0:.0f} s: "
            f"{(tmp / 'appliance').stat().st_size / 1e6:.1f} MB")
        tmp.rename(CACHE / key)
        for old in sorted((d for d in CACHE.iterdir() if d.is_dir() and d.name != key),
                          key=lambda d: d.stat().st_mtime)[:-2]:
            shutil.rmtree(old, ignore_errors=True)  # keep the two latest others
    return exe


def bare_env(tmpdir: Path, **extra: str) -> dict[str, str]:
    """What systemd would give: nothing of ours, a PATH, the TMPDIR the unit sets."""
    return {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmpdir), **{k: str(v) for k, v in extra.items()}}


class NotifySocket:
    """The datagram socket systemd would hold for a Type=notify service."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.got: list[tuple[float, str]] = []

    def wait_for(self, msg: str, timeout: float, count: int = 1) -> float:
        """Time of the `count`-th datagram with the line `msg`."""
        deadline = time.monotonic() + timeout
        while sum(msg in m.split("\n") for _, m in self.got) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"no {count} x {msg} in {timeout} s; got {[m for _, m in self.got]}"
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.got.append((time.monotonic(), data.decode()))
        return [t for t, m in self.got if msg in m.split("\n")][count - 1]

    def close(self) -> None:
        self.sock.close()


class Running:
    """The binary as a process: stderr collected, the `listening on` URLs parsed."""

    def __init__(self, argv: list[str], env: dict[str, str], preexec_fn=None) -> None:
        self.started = time.monotonic()
        self.popen = subprocess.Popen(argv, env=env, cwd="/", stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT,
                                      start_new_session=True, preexec_fn=preexec_fn)
        self.pid = self.popen.pid
        self.lines: list[str] = []
        self.urls: dict[str, str] = {}
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                self.lines.append(line)
                m = LISTEN_RE.search(line)
                if m:
                    self.urls.setdefault(m.group(1), m.group(2))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_listening(self, *roles: str, timeout: float = START_TIMEOUT) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(r in self.urls for r in roles):
                if time.monotonic() > deadline or self.popen.poll() is not None:
                    raise AssertionError(
                        f"not listening {roles} (exit={self.popen.poll()}):\n" + self.output())
                self._cond.wait(0.5)
        return self.urls

    def output(self) -> str:
        return "\n".join(self.lines[-40:])

    def child_pids(self) -> list[int]:
        """Processes of the tree below the bootloader (the Python child, and any more)."""
        return descendants(self.pid)

    def kill(self) -> None:
        kill_group(self.popen)


@pytest.fixture
def running():
    procs: list[Running] = []

    def start(*args, **kw) -> Running:
        p = Running(*args, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


# --- tests -------------------------------------------------------------------------------

def test_version_prints_version_and_commit(binary, tmp_path):
    r = subprocess.run([str(binary), "--version"], env=bare_env(tmp_path), cwd="/",
                       capture_output=True,
                       text=True, timeout=START_TIMEOUT)
    assert r.returncode == 0, r.stderr
    m = re.fullmatch(rf"appliance {re.escape(__version__)} \(([0-9a-f]{{7,}}(-dirty)?|unknown)\)\n",
                     r.stdout)
    assert m, r.stdout


def test_binary_carries_every_role_and_no_test_tooling(binary):
    # build.sh lists the archive beside the binary (pyi-archive_viewer, from the build venv).
    listing = (binary.parent / "appliance.contents.txt").read_text()
    names = set(re.findall(r"'([\w.]+)'", listing))
    roles = {"appliance.hub.run", "appliance.node.run", "appliance.up", "appliance.sim.server",
             "appliance.ctl",
             "appliance.observe.sdnotify", "appliance.server.tlsinfo"}
    roles |= {f"appliance.node.engines.{p.stem}"
              for p in (ROOT / "appliance/node/engines").glob("*.py")
              if p.stem != "__init__"}
    assert roles - names == set()
    assert {n for n in names if n.split(".")[0] in ("pytest", "_pytest", "hypothesis", "openai",
                                                    "ollama")} == set()
    # The hub's page (/ui/) rides along as data files beside its package.
    for f in ("index.html", "app.js", "style.css"):
        assert f"appliance/hub/api/ui/static/{f}" in listing, f


def test_units_verify_with_the_built_binary(binary, tmp_path):
    from tests.packaging.test_systemd_units import systemd_analyze, units_pointing_at, verify

    if systemd_analyze is None:
        pytest.skip("systemd-analyze missing")
    assert verify(units_pointing_at(str(binary), tmp_path)) == ""


ROLE_ENV = {
    "hub": {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
            "Hub__DrainSeconds": DRAIN_SECONDS,
            "Store__Path": ""},  # never the machine's /var/lib/appliance
    "node": {"Node__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Engine__Kind": "sim",
             "Auth__NodeToken": "t0ken", "Hub__DrainSeconds": DRAIN_SECONDS},
}


@pytest.mark.parametrize("role", ["hub", "node"])
def test_notify_protocol_from_root_in_a_bare_env(binary, tmp_path, running, role):
    """READY=1 once listening, WATCHDOG=1 every half WATCHDOG_USEC (WATCHDOG_PID naming
    the bootloader, as under systemd), RELOADING=1 + READY=1 around SIGHUP, STOPPING=1
    and exit 0 on SIGTERM -- both signals sent to the bootloader, which forwards them.
    Extraction happens under our TMPDIR and is cleaned up at exit."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    notify = NotifySocket(tmp_path / "notify.sock")
    env_file = tmp_path / f"{role}.env"
    env_file.write_text("Queue__MaxDepth=10\n")
    env = bare_env(tmpdir, NOTIFY_SOCKET=notify.path, WATCHDOG_USEC=1_000_000, **ROLE_ENV[role])
    # `exec` keeps the shell's pid: WATCHDOG_PID is the bootloader's, as systemd sets it.
    p = running(["/bin/sh", "-c", f'WATCHDOG_PID=$$ exec "{binary}" {role} --env-file {env_file}'],
                env)
    try:
        notify.wait_for("READY=1", START_TIMEOUT)
        url = p.wait_listening(role)[role]
        assert [d.name for d in tmpdir.iterdir()
                if d.name.startswith("_MEI")], "not extracted under TMPDIR"
        first = notify.wait_for("WATCHDOG=1", 5)
        third = notify.wait_for("WATCHDOG=1", 5, count=3)
        assert 0.5 < third - first < 2.5  # every 0.5 s
        if role == "hub":
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        env_file.write_text("Queue__MaxDepth=20\n")
        p.popen.send_signal(signal.SIGHUP)
        notify.wait_for("RELOADING=1", 10)
        notify.wait_for("READY=1", 10, count=2)
        p.popen.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1", 5)
        assert p.popen.wait(DRAIN_SECONDS + 5) == 0, p.output()
        assert not [d for d in tmpdir.iterdir()
                    if d.name.startswith("_MEI")], "extraction left behind"
    finally:
        notify.close()


# --- W^X: what MemoryDenyWriteExecute=yes in the hub unit relies on ------------------------

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1  # linux/prctl.h, Linux 6.3+


def _deny_write_execute() -> None:
    """preexec_fn: the kernel's own W^X switch, inherited across execve."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        os._exit(97)


def _elf_wants_exec_stack(data: bytes) -> bool:
    """True if an ELF64 little-endian object's PT_GNU_STACK asks for PF_X."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return False
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, p_flags = struct.unpack_from("<II", data, phoff + i * phentsize)
        if p_type == 0x6474E551:  # PT_GNU_STACK
            return bool(p_flags & 1)
    return phnum > 0  # no PT_GNU_STACK at all: the x86_64 loader assumes an executable stack


@pytest.mark.parametrize("role", ["hub", "node"])
def test_runs_without_write_execute_memory(binary, tmp_path, running, role):
    # First: does this kernel refuse W+X after the switch (and keep it across exec)?
    probe = subprocess.run(
        ["/bin/sh", "-c", 'exec "$0" -c "import mmap; mmap.mmap(-1, 4096, prot=7)"',
         shutil.which("python3") or "/usr/bin/python3"],
        preexec_fn=_deny_write_execute, capture_output=True, text=True, timeout=30)
    if probe.returncode == 97:
        pytest.skip("kernel without PR_SET_MDWE (Linux < 6.3)")
    assert probe.returncode != 0 and "ermission" in probe.stderr, "W+X mmap was allowed under MDWE"

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = bare_env(tmpdir, **{**ROLE_ENV[role], "Metrics__Listen": "127.0.0.1:0"})
    p = running([str(binary), role], env, preexec_fn=_deny_write_execute)
    urls = p.wait_listening(role, "metrics")
    if role == "hub":
        assert httpx.get(f"{urls['hub']}/health", timeout=10).status_code == 200
    assert httpx.get(f"{urls['metrics']}/metrics", timeout=10).status_code == 200
    # Every shared object the binary carries: none asks for an executable stack, which
    # glibc would have to mprotect(PROT_EXEC) -- refused by MemoryDenyWriteExecute=.
    (mei,) = [d for d in tmpdir.iterdir() if d.name.startswith("_MEI")]
    shared = [f for f in mei.rglob("*.so*") if f.is_file()]
    assert shared
    assert [str(f.relative_to(mei)) for f in shared
            if _elf_wants_exec_stack(f.read_bytes()[:65536])] == []
    p.popen.send_signal(signal.SIGTERM)
    assert p.popen.wait(DRAIN_SECONDS + 5) == 0, p.output()


# --- `appliance up`: the whole request path in the binary --------------------------------

def test_up_answers_a_chat_request_and_stops_on_sigterm(binary, tmp_path, running):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    notify = NotifySocket(tmp_path / "notify.sock")
    env = bare_env(tmpdir, NOTIFY_SOCKET=notify.path, Hub__Listen="127.0.0.1:0",
                   Node__Listen="127.0.0.1:0",
                   Sim__Listen="127.0.0.1:0", Metrics__Listen="", Hub__DrainSeconds=DRAIN_SECONDS,
                   Engine__Kind="sim")
    p = running([str(binary), "up"], env)
    try:
        url = p.wait_listening("hub")["hub"]
        ready_at = notify.wait_for("READY=1", START_TIMEOUT)
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "Say hello"}]}
        # The node may still be connecting: a real client retries a 503 too.
        r = wait_until(lambda: (lambda r: r if r.status_code != 503 else None)(
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)), timeout=60,
                       what="a non-503 answer")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        assert ready_at - p.started < START_TIMEOUT
        t0 = time.monotonic()
        p.popen.send_signal(signal.SIGTERM)
        assert p.popen.wait(DRAIN_SECONDS + 10) == 0, p.output()
        assert time.monotonic() - t0 <= DRAIN_SECONDS + 10
    finally:
        notify.close()


def test_up_exports_traces_from_the_executable(binary, tmp_path, running):
    """OpenTelemetry is in the executable: with OTEL_EXPORTER_OTLP_ENDPOINT set, the hub's
    and the node's spans of one chat reach an OTLP/HTTP receiver, in one trace."""
    from tests.e2e.test_trace_e2e import Receiver, _serve

    receiver = Receiver()
    endpoint = _serve(receiver)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = bare_env(tmpdir, Hub__Listen="127.0.0.1:0", Node__Listen="127.0.0.1:0",
                   Sim__Listen="127.0.0.1:0", Metrics__Listen="", Engine__Kind="sim",
                   Hub__DrainSeconds=DRAIN_SECONDS, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
    p = running([str(binary), "up"], env)
    try:
        url = p.wait_listening("hub")["hub"]
        body = {"model": "sim-small", "messages": [{"role": "user", "content": "Say hello"}]}
        r = wait_until(lambda: (lambda r: r if r.status_code != 503 else None)(
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)), timeout=60,
                       what="a non-503 answer")
        assert r.status_code == 200, r.text
        wait_until(lambda: receiver.of("appliance-hub") and receiver.of("appliance-node"), 30,
                   "spans from hub and node")
        hub_trace = {s.trace_id for s in receiver.of("appliance-hub") if s.name.startswith("chat")}
        node_trace = {s.trace_id for s in receiver.of("appliance-node")}
        assert hub_trace & node_trace, p.output()
    finally:
        receiver.shutdown()
