"""Where a node's engine listens: found in the command line of the node's child process, so
a test can ask the engine directly what it does with the same request (is a failure the
model's own, is the engine's slot busy)."""

from __future__ import annotations

from tests.harness.procfs import descendants
from tests.harness.procs import wait_until


def engine_url(node_pid: int, program: bytes = b"llama-server", without: bytes | None = None,
               having: bytes = b"") -> str:
    """http://127.0.0.1:PORT of the engine `program` the node `node_pid` started, one whose
    arguments do not hold `without` and one holds `having` (a model file's name) -- waits
    for it: the node starts it on the model's first request."""

    def found() -> str | None:
        for pid in descendants(node_pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    args = f.read().split(b"\0")
            except OSError:
                continue
            if (any(a.endswith(program) for a in args[:3]) and b"--port" in args
                    and (without is None or without not in args)
                    and any(having in a for a in args)):
                return f"http://127.0.0.1:{int(args[args.index(b'--port') + 1])}"
        return None

    url: str = wait_until(found, what=f"the port of {program.decode()}")
    return url
