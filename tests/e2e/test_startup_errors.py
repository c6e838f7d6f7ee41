"""Start-up failures are one line naming the variable, and exit code 2 -- not a traceback.

Real `appliance hub` processes: a port in use, a listen host that does not resolve, a TLS
file that is missing, an audit path that cannot be written, metrics on the API's port.
"""

from __future__ import annotations

import os
import socket

import pytest

from tests.harness.fleet import Fleet

pytestmark = pytest.mark.e2e


def run_hub(env: dict[str, str]) -> tuple[int, list[str]]:
    # No store: the suite never opens the machine's default (/var/lib/appliance).
    base = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Auth__NodeToken": "t",
            "Store__Path": ""}
    r = Fleet(token=None).run("hub", {**base, **env})
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def cases(tmp: str, port: int):
    afile = os.path.join(tmp, "a-file")
    open(afile, "w").close()  # a directory that is a file: unwritable even for root
    return [
        ({"Hub__Listen": f"127.0.0.1:{port}"}, "Hub__Listen", "in use"),
        ({"Hub__Listen": "no-such-host.invalid:0"}, "Hub__Listen", "cannot listen"),
        ({"Hub__TlsCert": os.path.join(tmp, "missing.pem")}, "Hub__TlsCert", "No such file"),
        ({"Audit__Path": os.path.join(afile, "audit.log")}, "Audit__Path", "audit.log"),
        ({"Hub__Listen": "127.0.0.1:18080", "Metrics__Listen": "127.0.0.1:18080"},
         "Metrics__Listen", "API's port"),
    ]


def test_each_start_up_failure_is_one_line_and_exit_2(tmp_path, busy_port):
    for env, var, words in cases(str(tmp_path), busy_port):
        code, lines = run_hub(env)
        assert code == 2, (env, lines)
        assert len(lines) == 1, (env, lines)
        assert var in lines[
            0] and words in lines[0] and lines[0].startswith("appliance hub: "), lines


def test_the_audit_file_is_created_0600(tmp_path):
    from appliance.hub.observe.audit import AuditLog, check_path

    path = tmp_path / "audit.log"
    log = AuditLog(str(path))
    log.event("x")
    assert (path.stat().st_mode & 0o777) == 0o600
    checked = tmp_path / "checked.log"  # the start-up check creates it, 0600 too
    assert check_path(str(checked)) is None and (checked.stat().st_mode & 0o777) == 0o600
