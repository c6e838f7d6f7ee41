"""What a running process holds, read off /proc: the one copy the e2e tests and bench/ use.

Linux only. `socket_inodes` names the sockets in a process's fd table; a row of
/proc/net/tcp{,6} (`tcp_rows`: local, remote, state, ..., inode at index 9) ties a
connection to one of them -- that is how a test learns which process accepted a
connection, or how many connections a process has left in CLOSE-WAIT. Sizes (RSS, fds)
are for leak checks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx

ESTABLISHED, CLOSE_WAIT = "01", "08"


def children(pid: int) -> list[int]:
    """The child processes of `pid` (of all its threads)."""
    out: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def peak_rss_kb(pid: int) -> int:
    """The process's peak resident set (VmHWM) so far."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM for pid {pid}")


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
