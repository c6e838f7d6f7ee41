"""Build llama-cpp-python once, cache the wheel, install it into a venv from the cache.

Theory of operation: llama-cpp-python has no binary wheel on the index for this version;
`pip install` compiles llama.cpp, about 5 minutes on two cores. So `make test` runs this
script: the first time it builds the wheel into `~/.cache/appliance/wheels` (outside the
clone, so every clone and CI run on this machine reuses it), after that it only installs
`llama-cpp-python[server]` from there (seconds). The version is pinned: unpinned, pip would
compile a newer sdist the day one appears. Built with `-DGGML_NATIVE=OFF` so the cached
wheel does not carry this CPU's `-march=native` to another machine. A file lock keeps two
concurrent runs from building twice.

    python tests/llama_cache.py            # ensure the wheel, install into this interpreter
    python tests/llama_cache.py --wheel-only
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("APPLIANCE_CACHE_DIR", Path.home() / ".cache" / "appliance"))
WHEELS = CACHE / "wheels"


def cached_wheel() -> Path | None:
    found = sorted(glob.glob(str(WHEELS / f"llama_cpp_python-{VERSION}-*.whl")))
    return Path(found[-1]) if found else None


def ensure_wheel() -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    with open(WHEELS / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheel = cached_wheel()
        if wheel is not None:
            return wheel
        print(f"llama_cache: building llama-cpp-python=={VERSION} (minutes, once) into {WHEELS}",
              flush=True)
        t0 = time.monotonic()
        env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=OFF",
                   CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2"))
        with tempfile.TemporaryDirectory(dir=WHEELS) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            f"llama-cpp-python=={VERSION}", "-w", tmp], env=env, check=True)
            (built,) = Path(tmp).glob("llama_cpp_python-*.whl")
            os.replace(built, WHEELS / built.name)  # whole or not at all
        print(f"llama_cache: built in {time.monotonic() - t0:.0f} s", flush=True)
        wheel = cached_wheel()
        assert wheel is not None
        return wheel


def installed_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return ""


def ensure_installed() -> None:
    if installed_version() == VERSION and shutil.which("uvicorn",
                                                       path=str(Path(sys.executable).parent)):
        return
    ensure_wheel()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--find-links", str(WHEELS),
                    f"llama-cpp-python[server]=={VERSION}"], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel-only", action="store_true")
    opts = ap.parse_args()
    if opts.wheel_only:
        print(ensure_wheel())
    else:
        ensure_installed()
        print(f"llama_cache: llama-cpp-python {installed_version()} from {WHEELS}")


if __name__ == "__main__":
    main()
