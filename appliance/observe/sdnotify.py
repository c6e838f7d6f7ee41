"""systemd's notify protocol (READY, STOPPING, RELOADING, WATCHDOG), without a dependency.

Theory of operation: systemd gives a `Type=notify` service a datagram socket in
`$NOTIFY_SOCKET` (a path, or `@name` in the abstract namespace) and, with `WatchdogSec=`,
`$WATCHDOG_USEC` and `$WATCHDOG_PID`. A notification is one datagram of `KEY=VALUE`
lines. This module owns sending them and one decision: may this process feed the
watchdog? Only when `$WATCHDOG_PID` names it -- or, in the PyInstaller onefile binary, its
parent, because the bootloader is the process systemd started and our Python runs in its
child (which is why the units say `NotifyAccess=all`). We ping at half of
`$WATCHDOG_USEC`, as sd_watchdog_enabled(3) advises, and only while the caller's
`alive()` says the main loop really ran recently: a hung control loop must let systemd
restart us. Without a socket (not under systemd, or a test) every send is a no-op,
logged once; a failing send is logged once and never raised -- the service must not
die because its supervisor went away.

The variables are left in the environment (an engine the node spawns may be given
`without_notify_env(os.environ)`, so it cannot speak for us).

How the hub's and the node's `run.py` use it (the whole integration)::

    from appliance.observe import sdnotify

    notifier = sdnotify.Notifier.from_env()
    heartbeat = sdnotify.Liveness(max_age=3 * cfg.hub.control_interval_seconds)
    async with trio.open_nursery() as nursery:
        ...                                   # nursery.start(...) every listener
        notifier.ready()                      # after the last listener is bound
        nursery.start_soon(sdnotify.watchdog_loop, notifier, heartbeat)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                if sig == signal.SIGHUP:
                    notifier.reloading()
                    ...                       # re-read --env-file, apply or refuse
                    notifier.ready()
                else:
                    notifier.stopping()
                    ...                       # stop accepting, drain, cancel
                    break

    # in the control loop (hub) / heartbeat loop (node), once per iteration:
    heartbeat.beat()
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping

import trio

log = logging.getLogger(__name__)

NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def without_notify_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of `environ` without the notify variables, for a child process."""
    return {k: v for k, v in environ.items() if k not in NOTIFY_VARS}


def _address(path: str) -> str | bytes:
    """`@name` is the abstract namespace: a leading NUL byte on the wire."""
    if path.startswith("@"):
        return b"\0" + path[1:].encode()
    return path


class Notifier:
    """Sends notifications to one socket; knows whether it may feed the watchdog."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self.socket_path = socket_path or None
        self.watchdog_usec = watchdog_usec
        self._warned = False

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        pid: int | None = None,
        ppid: int | None = None,
        frozen: bool | None = None,
    ) -> Notifier:
        """Read $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID (see the module doc)."""
        env = os.environ if environ is None else environ
        pid = os.getpid() if pid is None else pid
        ppid = os.getppid() if ppid is None else ppid
        frozen = bool(getattr(sys, "frozen", False)) if frozen is None else frozen
        usec = _positive_int(env.get("WATCHDOG_USEC"))
        wpid = env.get("WATCHDOG_PID")
        if usec is not None and wpid:
            owner = _positive_int(wpid)
            allowed = {pid, ppid} if frozen else {pid}
            if owner not in allowed:
                log.debug("WATCHDOG_PID=%s is not this process (%d): no watchdog", wpid, pid)
                usec = None
        return cls(env.get("NOTIFY_SOCKET"), usec)

    def watchdog_interval(self) -> float | None:
        """Seconds between two WATCHDOG=1 pings (half of WATCHDOG_USEC), or None."""
        if self.watchdog_usec is None:
            return None
        return self.watchdog_usec / 2 / 1e6

    def notify(self, msg: str) -> bool:
        """Send one notification; True if it was sent. Never raises."""
        if not self.socket_path:
            if not self._warned:
                self._warned = True
                log.debug("no NOTIFY_SOCKET (not started by systemd): %s not sent",
                          msg.split("\n")[0])
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.connect(_address(self.socket_path))
                s.sendall(msg.encode())
            return True
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("sd_notify to %s failed: %s (further failures not logged)",
                            self.socket_path, e)
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def reloading(self) -> bool:
        # Type=notify-reload (systemd 253) wants the monotonic time of the reload's start.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")


def _positive_int(text: str | None) -> int | None:
    try:
        n = int(text or "")
    except ValueError:
        return None
    return n if n > 0 else None


class Liveness:
    """`beat()` from the loop that must stay alive; calling the object asks whether it did
    within `max_age` seconds (trio time). A fresh Liveness counts as alive. (The watch
    stream's `wire.Heartbeat` line is another thing: this is systemd's watchdog.)"""

    def __init__(self, max_age: float) -> None:
        self.max_age = max_age
        self._last: float | None = None

    def beat(self) -> None:
        self._last = trio.current_time()

    def __call__(self) -> bool:
        if self._last is None:
            self.beat()
        return self._last is not None and trio.current_time() - self._last <= self.max_age


async def watchdog_loop(notifier: Notifier, alive: Callable[[], bool]) -> None:
    """Send WATCHDOG=1 every `watchdog_interval()` while `alive()`; returns at once when
    there is no watchdog. A trio task: `nursery.start_soon(watchdog_loop, notifier, alive)`."""
    interval = notifier.watchdog_interval()
    if interval is None:
        return
    was_alive = True
    while True:
        ok = alive()
        if ok:
            notifier.watchdog()
        elif was_alive:
            log.error("main loop stalled: withholding WATCHDOG=1 so systemd restarts us")
        was_alive = ok
        await trio.sleep(interval)


async def beat_loop(heartbeat: Liveness, interval: float) -> None:
    """Proves the trio loop turns: the watchdog is fed only while this runs on time."""
    while True:
        heartbeat.beat()
        await trio.sleep(interval)
