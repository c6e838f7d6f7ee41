"""What a running process holds, read off /proc: the one copy the e2e tests and bench/ use.

Linux only. `socket_inodes` names the sockets in a process's fd table; a row of
/proc/net/tcp{,6} (`tcp_rows`: local, remote, state, ..., inode at index 9) ties a
connection to one of them -- that is how a test learns which process accepted a
connection, or how many connections a process has left in CLOSE-WAIT. Sizes (RSS, fds)
are for leak checks; CPU seconds (utime + stime of proc(5)'s stat, a process's or each of
its threads') are what the benches count per request.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx

ESTABLISHED, CLOSE_WAIT = "01", "08"
TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The child processes of `pid` (of all its threads)."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its children, theirs, ...); one gone meanwhile has none."""
    out: list[int] = []
    todo = [pid]
    while todo:
        try:
            kids = children(todo.pop())
        except OSError:
            continue
        out += kids
        todo += kids
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {key} for pid {pid}")


def rss_kb(pid: int) -> int:
    return _status_kb(pid, "VmRSS")


def peak_rss_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM) so far."""
    return _status_kb(pid, "VmHWM")


def _stat_cpu(path: str, kernel_only: bool = False) -> float:
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return ((0 if kernel_only else int(fields[11])) + int(fields[12])) / TICKS


def cpu_seconds(pid: int, kernel_only: bool = False) -> float:
    """utime + stime of `pid` so far (stime only with kernel_only: the syscalls' share)."""
    return _stat_cpu(f"/proc/{pid}/stat", kernel_only)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each of the process's threads, by thread id (the main thread's is `pid`)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = _stat_cpu(f"/proc/{pid}/task/{tid}/stat")
        except FileNotFoundError:  # a thread that ended
            continue
    return out


def loop_and_rest(pid: int, before: dict[int, float]) -> tuple[float, float]:
    """CPU seconds since `before` (a `thread_cpu(pid)`): the main thread's (a trio process's
    loop) and its other threads' together (one begun since counts whole, one ended is lost)."""
    now = thread_cpu(pid)
    rest = sum(v - before.get(tid, 0.0) for tid, v in now.items() if tid != pid)
    return now.get(pid, 0.0) - before.get(pid, 0.0), rest


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets open in `pid`'s fd table."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed while we looked
            continue
        if link.startswith("socket:["):
            found.add(link[8:-1])
    return found


def tcp_rows() -> Iterator[list[str]]:
    """Each row of /proc/net/tcp and /proc/net/tcp6, split on whitespace."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    yield line.split()
        except FileNotFoundError:
            pass


def port_of(address: str) -> int:
    """The port of a /proc/net/tcp address (`HEXIP:HEXPORT`)."""
    return int(address.rsplit(":", 1)[1], 16)


def close_wait(*, port: int | None = None, inodes: set[str] | None = None) -> int:
    """Sockets in CLOSE-WAIT whose local port is `port` and/or whose inode is in `inodes`."""
    return sum(1 for p in tcp_rows()
               if p[3] == CLOSE_WAIT and (port is None or port_of(p[1]) == port)
               and (inodes is None or p[9] in inodes))


def server_inode(server_port: int, client_port: int) -> str:
    """The inode of the server's side of the established connection from `client_port`."""
    for p in tcp_rows():
        if p[3] == ESTABLISHED and port_of(p[1]) == server_port and port_of(p[2]) == client_port:
            return p[9]
    return ""


def client_port(c: httpx.Client, path: str = "/health") -> int:
    """Make `c` open (and keep) a connection with a GET of `path`; its local port."""
    r = c.get(path)
    assert r.status_code == 200
    return int(r.extensions["network_stream"].get_extra_info("client_addr")[1])


def owner(c: httpx.Client, server_port: int, pids: list[int], path: str = "/health") -> int:
    """The pid (of `pids`) that accepted the connection `c` keeps to `server_port`; 0: none."""
    inode = server_inode(server_port, client_port(c, path))
    return next((pid for pid in pids if inode and inode in socket_inodes(pid)), 0)
