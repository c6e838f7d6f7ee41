"""Start real `appliance` processes for end-to-end tests, as an operator would.

Each process runs `python -m appliance ROLE` with a clean copy of the environment plus
the variables the test gives, on ports the OS picks (`...Listen=127.0.0.1:0`). We learn
the ports from the `appliance <role> listening on http://HOST:PORT` lines on stderr --
a readiness check, not a sleep -- and stop processes by pid.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

LISTEN_RE = re.compile(r"appliance (\w+) listening on (https?://\S+)")
# Generous: a cold Python start with imports on a loaded 2-core machine.
START_TIMEOUT = 30.0


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "__" not in k and not k.startswith("APPLIANCE_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS's pick, bound then closed):
    for a process that must be told its port, or a peer that is down."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(fn, timeout: float = 20.0, what: str = "condition", interval: float = 0.05):
    """Readiness check on a running process: poll a cheap condition until a deadline.

    For processes only (a port, a status field); logic with time in it is tested under
    trio's MockClock instead.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    last = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        pause.wait(interval)
    raise AssertionError(f"timed out waiting for {what}; last={last!r}")


class Proc:
    def __init__(self, role: str, env: dict[str, str], args: list[str] = (),
                 cwd: str | None = None) -> None:
        self.role = role
        if role == "hub":  # no store unless the caller names one (the default is /var/lib)
            env = {"Store__Path": "", **env}
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "appliance", role, *args],
            env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []
        self.urls: dict[str, str] = {}
        self._cond = threading.Condition()
        for stream, sink in ((self.popen.stderr, self.stderr_lines), (self.popen.stdout,
                                                                      self.stdout_lines)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink: list[str]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._cond:
                sink.append(line)
                m = LISTEN_RE.search(line)
                if m and sink is self.stderr_lines:
                    self.urls.setdefault(m.group(1), m.group(2))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float = START_TIMEOUT, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not predicate()):
                    raise AssertionError(
                        f"{self.role}: {what or 'condition'} not met (exit={self.popen.poll()});"
                        f" stderr:\n" + "\n".join(self.stderr_lines[-40:]))
                self._cond.wait(min(left, 0.5))

    def wait_listening(self, *roles: str) -> dict[str, str]:
        roles = roles or (self.role,)
        self.wait_for(lambda: all(r in self.urls for r in roles), what=f"listening {roles}")
        return self.urls

    def wait_stderr(self, pattern: str, timeout: float = START_TIMEOUT) -> str:
        rx = re.compile(pattern)
        found: list[str] = []

        def pred() -> bool:
            for line in self.stderr_lines:
                if rx.search(line):
                    found.append(line)
                    return True
            return False

        self.wait_for(pred, timeout, what=f"stderr matching {pattern!r}")
        return found[0]

    @property
    def url(self) -> str:
        return self.urls[self.role]

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.pid, sig)

    def wait_exit(self, timeout: float = START_TIMEOUT) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        kill_group(self.popen)


def kill_group(popen: subprocess.Popen) -> None:
    """SIGKILL to a process started with `start_new_session` and all in its group, reaped."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait(10)


class Procs:
    """Starts processes and kills whatever is left at the end of the test."""

    def __init__(self) -> None:
        self.all: list[Proc] = []

    def start(self, role: str, env: dict[str, str], args: list[str] = (),
              wait: tuple[str, ...] | None = None, tree: str | None = None) -> Proc:
        """`role` started and listening; with `tree` (a checkout of this repository: the
        benches that set two trees side by side) it imports that tree's `appliance`."""
        if tree is not None:
            env = dict(env, PYTHONPATH=tree)
        p = Proc(role, env, args, cwd=tree)
        self.all.append(p)
        p.wait_listening(*(wait or (role,)))
        return p

    def hub(self, env: dict[str, str] | None = None, metrics: bool = True,
            args: list[str] = ()) -> Proc:
        e = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "127.0.0.1:0" if metrics else "",
             "Node__HeartbeatSeconds": "0.5", "Hub__DrainSeconds": "5"}
        e.update(env or {})
        return self.start("hub", e, args, wait=("hub", "metrics") if metrics else ("hub",))

    def node(self, name: str, env: dict[str, str] | None = None,
             args: list[str] = ()) -> Proc:
        e = {"Node__Name": name, "Node__Listen": "127.0.0.1:0", "Metrics__Listen": "",
             "Engine__Kind": "sim", "Node__HeartbeatSeconds": "0.5", "Sim__TokensPerSecond": "0"}
        e.update(env or {})
        return self.start("node", e, args)

    def close(self) -> None:
        for p in self.all:
            p.kill()


@pytest.fixture
def procs():
    p = Procs()
    try:
        yield p
    finally:
        p.close()
