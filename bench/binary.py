"""The one-file executable as an operator meets it: size, start to READY=1, RSS at idle.

Run: .venv/bin/python bench/binary.py [--runs N]

Builds (or reuses, keyed by the sources) dist-like `appliance` with packaging/build.sh,
then starts the hub, the node (sim engine) and `up` N times each from `/` with a bare
environment and a notify socket, as systemd would, and prints the median time from exec
to READY=1 and the RSS of the Python process (and the onefile bootloader) after a second
idle. The source tree (`python -m appliance`) is started the same way beside it for the
ratio.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.packaging.test_binary import (  # noqa: E402
    ROLE_ENV,
    NotifySocket,
    Running,
    bare_env,
    build_binary,
    rss_mib,
)

UP_ENV = {"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "", "Engine__Kind": "sim",
          "Hub__DrainSeconds": 3}


def one_start(argv: list[str], role_env: dict, extra_env: dict) -> tuple[float, float, float]:
    """(seconds to READY=1, RSS MiB of the Python process, RSS MiB of the bootloader or 0)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "tmp"
        tmp.mkdir()
        notify = NotifySocket(Path(d) / "notify.sock")
        p = Running(argv, {**bare_env(tmp, NOTIFY_SOCKET=notify.path, **role_env), **extra_env})
        try:
            ready = notify.wait_for("READY=1", 60) - p.started
            time.sleep(1.0)  # idle
            kids = p.child_pids()
            py = kids[0] if kids else p.pid
            boot = rss_mib(p.pid) if kids else 0.0
            return ready, rss_mib(py), boot
        finally:
            p.popen.send_signal(signal.SIGTERM)
            p.popen.wait(15)
            notify.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    t0 = time.monotonic()
    exe = build_binary()
    print(
        f"binary: {exe} ({exe.stat().st_size / 1e6:.1f} MB; build or cache lookup took "
        f"{time.monotonic() - t0:.0f} s)")
    source_env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    print(
        f"{'role':<6}{'how':<8}{'READY=1 s (median)':>20}{'RSS MiB':>10}{'+boot MiB':>11}{'READY x':>9}")
    for role, env in (("hub", ROLE_ENV["hub"]), ("node", ROLE_ENV["node"]), ("up", UP_ENV)):
        rows = {}
        for how, argv, extra in (("binary", [str(exe), role], {}),
                                 ("source", [sys.executable, "-m", "appliance", role], source_env)):
            runs = [one_start(argv, env, extra) for _ in range(args.runs)]
            rows[how] = (statistics.median(r[0] for r in runs), statistics.median(r[1]
                                                                                  for r in runs),
                         statistics.median(r[2] for r in runs))
        for how, (ready, rss, boot) in rows.items():
            ratio = ready / rows["source"][0]
            print(f"{role:<6}{how:<8}{ready:>20.2f}{rss:>10.1f}{boot:>11.1f}{ratio:>9.2f}")


if __name__ == "__main__":
    os.chdir("/")
    main()
