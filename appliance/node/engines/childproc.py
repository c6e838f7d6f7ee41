"""Engine child processes that die with the node, even when it is killed with SIGKILL.

Theory of operation: a `Child` is forked from the calling (trio) thread into its own
process group (`start_new_session`), with a parent-death signal set between fork and exec
(prctl PR_SET_PDEATHSIG=SIGKILL, Linux). The kernel sends that signal when the *thread*
that forked exits, so the fork must not happen in a worker thread: trio's
`open_process` forks in a cached worker thread that exits after 10 s idle, which would
kill the engine 10 s after its start. Popen here blocks the trio thread for the few
milliseconds a fork+exec takes; the exit is awaited through a pidfd (Linux >= 5.3; older
kernels fall back to a 50 ms poll). stdout and stderr share one pipe, `output`, which the
owner must read continuously.

Stopping is the owner's: `signal()` reaches the whole group (wrappers and what they
started); `wait()` sweeps the group with SIGKILL before reaping the leader, so nothing
outlives it. On interpreter exit every live group gets SIGKILL (atexit); a SIGKILL of the
node is left to the kernel (the parent-death signal reaches the leader; wrappers should
`exec` the server so that the leader is the server).

The command line is built here too: `Engine__Command` expanded with the model, a free
loopback port and the profile's arguments, plus the model's name as the server's alias.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys

import trio

_PR_SET_PDEATHSIG = 1
_live_groups: set[int] = set()


def _kill_live_groups() -> None:
    for pgid in list(_live_groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass


atexit.register(_kill_live_groups)


class Child:
    """One engine process, forked from this thread, in its own group, watched by pidfd."""

    def __init__(self, argv: list[str]) -> None:
        parent = os.getpid()
        prctl = None
        if sys.platform.startswith("linux"):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

        def in_child() -> None:  # between fork and exec: no locks, no allocation to speak of
            if prctl is not None:
                prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:  # the node died before prctl took hold
                os.kill(os.getpid(), signal.SIGKILL)

        read_fd, write_fd = os.pipe()
        try:
            self.popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd,
                start_new_session=True, preexec_fn=in_child,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self.pid = self.popen.pid
        _live_groups.add(self.pid)
        self.output = trio.lowlevel.FdStream(read_fd)
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self._pidfd = None
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Wait for the exit (one waiter at a time); the group is swept before reaping."""
        if self.returncode is not None:
            return self.returncode
        if self._pidfd is not None:
            await trio.lowlevel.wait_readable(self._pidfd)
        else:
            while self.popen.poll() is None:  # no pidfd (old kernel): a bounded-step poll
                await trio.sleep(0.05)
        self.signal(signal.SIGKILL)  # whatever the leader left behind in its group
        self.returncode = self.popen.wait()
        _live_groups.discard(self.pid)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        return self.returncode

    def signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.killpg(self.pid, sig)
            except OSError:
                pass


def expand_command(template: str, model: str, port: int, args: str) -> list[str]:
    """`Engine__Command` -> argv: `{args}` as a word becomes the profile's words."""
    argv: list[str] = []
    for word in shlex.split(template):
        if word == "{args}":
            argv.extend(shlex.split(args))
            continue
        word = word.replace("{model}", model).replace("{port}", str(port))
        argv.append(word.replace("{args}", args))
    return argv


_ALIAS_FLAGS = ("-a", "--alias", "--model_alias", "--model-alias")


def with_alias(argv: list[str], name: str) -> list[str]:
    """`argv` with the model's name as the server's own: both servers otherwise answer
    with the file path as `model` (a path in every client's answer). Only for the two
    servers known by their command, and only where the operator named no alias."""
    if any(a in _ALIAS_FLAGS or a.split("=", 1)[0] in _ALIAS_FLAGS for a in argv):
        return argv
    if argv[1:3] == ["-m", "llama_cpp.server"]:
        return [*argv, "--model_alias", name]
    if argv and os.path.basename(argv[0]).startswith("llama-server"):
        return [*argv, "--alias", name]
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
