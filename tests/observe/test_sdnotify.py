"""sd_notify: datagrams on a socket the test binds, the watchdog under autojump_clock."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from appliance.observe import sdnotify
from appliance.observe.sdnotify import Liveness, Notifier, watchdog_loop


@pytest.fixture
def sock(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.setblocking(False)
    yield path, s
    s.close()


def drain(s: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(s.recv(4096).decode())
        except BlockingIOError:
            return out


def test_ready_stopping_reloading_watchdog(sock):
    path, s = sock
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.ready() and n.watchdog() and n.stopping() and n.reloading()
    got = drain(s)
    assert got[:3] == ["READY=1", "WATCHDOG=1", "STOPPING=1"]
    first, second = got[3].split("\n")
    assert first == "RELOADING=1"
    assert second.startswith("MONOTONIC_USEC=") and int(second.split("=")[1]) > 0


def test_ready_with_status(sock):
    path, s = sock
    Notifier(path).ready("hub on 127.0.0.1:8080")
    assert drain(s) == ["READY=1\nSTATUS=hub on 127.0.0.1:8080"]


def test_abstract_namespace():
    name = f"appliance-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(b"\0" + name.encode())
    s.setblocking(False)
    try:
        assert Notifier.from_env({"NOTIFY_SOCKET": "@" + name}).ready()
        assert drain(s) == ["READY=1"]
    finally:
        s.close()


def test_missing_socket_is_not_fatal(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert Notifier.from_env().notify("READY=1") is False
    n = Notifier.from_env({})
    assert n.ready() is False and n.stopping() is False
    # A socket path nobody listens on: logged once, never raised.
    gone = Notifier(str(tmp_path / "nobody.sock"))
    with caplog.at_level("WARNING", logger="appliance.observe.sdnotify"):
        assert gone.ready() is False
        assert gone.watchdog() is False
    assert len([r for r in caplog.records if "sd_notify" in r.message]) == 1


def test_watchdog_interval_is_half_of_usec():
    n = Notifier.from_env({"WATCHDOG_USEC": "20000000"}, pid=10, ppid=1)
    assert n.watchdog_interval() == 10.0
    assert Notifier.from_env({}).watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "junk"}).watchdog_interval() is None
    assert Notifier.from_env({"WATCHDOG_USEC": "0"}).watchdog_interval() is None


@pytest.mark.parametrize(
    "wpid, frozen, expect",
    [
        ("10", False, 10.0),  # our own pid
        ("10", True, 10.0),
        ("7", True, 10.0),  # the onefile bootloader is our parent
        ("7", False, None),  # not frozen: the parent is somebody else
        ("99", True, None),  # another process entirely
        ("99", False, None),
    ],
)
def test_watchdog_pid(wpid, frozen, expect):
    env = {"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": wpid}
    n = Notifier.from_env(env, pid=10, ppid=7, frozen=frozen)
    assert n.watchdog_interval() == expect


def test_without_notify_env():
    env = {"PATH": "/bin", "NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2"}
    assert sdnotify.without_notify_env(env) == {"PATH": "/bin"}


async def test_watchdog_loop_pings_at_half_usec_while_alive(sock, autojump_clock):
    path, s = sock
    n = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000"})
    sent: list[float] = []
    real = n.watchdog

    def spy():
        sent.append(trio.current_time())
        return real()

    n.watchdog = spy
    alive = True
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog_loop, n, lambda: alive)
        await trio.sleep(6.5)
        alive = False
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert sent == [start, start + 2, start + 4, start + 6]
    assert drain(s) == ["WATCHDOG=1"] * 4


async def test_watchdog_loop_resumes_when_alive_again(sock, autojump_clock):
    path, s = sock
    n = Notifier(path, watchdog_usec=2_000_000)
    hb = Liveness(max_age=3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watchdog_loop, n, hb)
        await trio.sleep(0.5)
        assert drain(s) == ["WATCHDOG=1"]  # fresh heartbeat counts as alive
        await trio.sleep(5)  # no beat for 5.5 s > max_age 3: pings stop after t=3
        assert drain(s) == ["WATCHDOG=1"] * 3  # t=1, 2, 3
        hb.beat()
        await trio.sleep(0.6)  # t=6.1: the ping at t=6 went out
        assert drain(s) == ["WATCHDOG=1"]
        nursery.cancel_scope.cancel()


async def test_watchdog_loop_returns_without_watchdog(sock, autojump_clock):
    path, s = sock
    start = trio.current_time()
    await watchdog_loop(Notifier.from_env({"NOTIFY_SOCKET": path}), lambda: True)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}
    await watchdog_loop(Notifier.from_env(env, pid=4242, ppid=4241, frozen=True), lambda: True)
    assert trio.current_time() == start
    assert drain(s) == []
