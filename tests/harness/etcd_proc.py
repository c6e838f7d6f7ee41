"""A real etcd (Debian's etcd-server) for the HA tests: free loopback ports, a temp data dir.

`EtcdProc(tmp)` starts one member; `stop()` kills it by pid (the data dir stays, so
`start()` brings the same cluster back on the same ports, as a restarted service would).
etcd needs its ports named up front (it advertises them), so they are found free by
binding port 0 and closing -- the only place the tests do that.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import httpx
import pytest

from tests.harness.procs import free_port

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
needs_etcd = pytest.mark.skipif(ETCD is None,
                                reason="etcd missing (make test installs Debian's etcd-server)")


class EtcdProc:
    """`tls=(ca, cert, key)`: clients must speak HTTPS and show a certificate the CA signed."""

    def __init__(self, data_dir, tls: tuple[str, str, str] | None = None) -> None:
        self.data_dir = str(data_dir)
        self.tls = tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.client_port}"
        self.log = open(os.path.join(os.path.dirname(self.data_dir), "etcd.log"), "ab")
        self.popen: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.popen = subprocess.Popen(
            [ETCD, "--name", "t", "--data-dir", self.data_dir, "--listen-client-urls", self.url,
             "--advertise-client-urls", self.url, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
             *self._tls_args()],
            stdout=self.log, stderr=self.log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1,
                             verify=self._verify()).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if self.popen.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.popen.returncode}; see {self.log.name}")
            time.sleep(0.1)
        raise RuntimeError(f"etcd not healthy within {timeout} s; see {self.log.name}")

    def _tls_args(self) -> list[str]:
        if not self.tls:
            return []
        ca, cert, key = self.tls
        return ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                "--client-cert-auth"]

    def _verify(self):
        if not self.tls:
            return True
        import ssl

        ctx = ssl.create_default_context(cafile=self.tls[0])
        ctx.load_cert_chain(self.tls[1], self.tls[2])
        return ctx

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def close(self) -> None:
        self.stop()
        self.log.close()
