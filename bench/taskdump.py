"""Where a running appliance process waits: every trio task's coroutine stack, from outside.

Run: .venv/bin/python bench/taskdump.py PID [PID...]   (writes /tmp/taskdump-PID.txt each)

py-spy shows a trio process idle in epoll and nothing more (tasks are coroutines, not
threads). This attaches gdb to the process, runs a few lines of Python in it (the GIL
taken; the loop is idle in epoll_wait, which the interruption restarts) that write each
trio Task's name and its await chain -- file:line and function, with the locals of
frames named in WANT -- to a file, and detaches; the process goes on as before. Needs gdb
and ptrace rights (root, or the same user with ptrace_scope 0). bench/cost_cpu.py calls it
for every process of a run when a request has waited STALL_DUMP_SECONDS.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

# Frames whose locals are written too (a deadline, a buffer, what was read).
WANT = ("_generate", "sleep_until", "_exchange", "_read_head", "_wait", "receive", "_forward",
        "_relay", "relay_body", "_wait_disconnect", "_body")

_SNIPPET = r'''
import gc, os, traceback
def _taskdump(out_path, want):
    import trio
    out = open(out_path, "w")
    try:
        now = trio.current_time()
    except Exception:
        now = None
    tasks = [o for o in gc.get_objects()
             if type(o).__name__ == "Task" and type(o).__module__.startswith("trio")]
    out.write(f"pid {os.getpid()}: {len(tasks)} trio tasks, trio now {now}\n")
    for t in tasks:
        out.write(f"\n== {t.name}\n")
        c, depth = t.coro, 0
        while c is not None and depth < 80:
            depth += 1
            f = getattr(c, "cr_frame", None) or getattr(c, "ag_frame", None) or getattr(c, "gi_frame", None)
            if f is not None:
                out.write(f"  {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}\n")
                if f.f_code.co_name in want:
                    for k, v in f.f_locals.items():
                        out.write(f"      {k} = {repr(v)[:200]}\n")
            nxt = getattr(c, "cr_await", None)
            if nxt is None:
                nxt = getattr(c, "ag_await", None)
            if nxt is None:
                nxt = getattr(c, "gi_yieldfrom", None)
            if nxt is None and f is None:
                out.write(f"  <{type(c).__name__}>\n")
            c = nxt
    out.close()
try:
    _taskdump(OUT, WANT)
except Exception:
    open(OUT + ".err", "w").write(traceback.format_exc())
'''


def dump(pid: int, out_path: str) -> str:
    """Write `pid`'s trio tasks to `out_path`; "" when done, else why not."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "no gdb"
    fd, script = tempfile.mkstemp(prefix="taskdump-", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(f"OUT = {out_path!r}\nWANT = set({WANT!r})\n" + _SNIPPET)
    os.chmod(script, 0o644)
    code = f'exec(open(\\"{script}\\").read())'
    try:
        r = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "call (int)PyGILState_Ensure()",
                            "-ex", f'call (int)PyRun_SimpleString("{code}")',
                            "-ex", "call (void)PyGILState_Release($1)"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"gdb: {e}"
    finally:
        os.unlink(script)
    if os.path.exists(out_path + ".err"):
        with open(out_path + ".err") as f:
            return f.read()
    if not os.path.exists(out_path):
        return f"gdb wrote nothing (exit {r.returncode}): {r.stderr.strip()[-300:]}"
    return ""


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        path = f"/tmp/taskdump-{arg}.txt"
        print(path, dump(int(arg), path) or "ok")
