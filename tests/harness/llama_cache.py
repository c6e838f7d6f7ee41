"""Build llama-cpp-python and llama.cpp's llama-server once, cache them outside the clone.

Theory of operation: llama-cpp-python has no binary wheel on the index for this version;
`pip install` compiles llama.cpp, about 5 minutes on two cores. So `make test` runs this
script: the first time it builds the wheel into `~/.cache/appliance/wheels` (outside the
clone, so every clone and CI run on this machine reuses it), after that it only installs
`llama-cpp-python[server]` from there (seconds). The version is pinned: unpinned, pip would
compile a newer sdist the day one appears. Built with `-DGGML_NATIVE=OFF` so the cached
wheel does not carry this CPU's `-march=native` to another machine. A file lock keeps two
concurrent runs from building twice.

llama-server, the server fleets run (Ollama runs it underneath), is built the same way
from the same pin: from the llama.cpp sources that the llama-cpp-python sdist vendors
(`vendor/llama.cpp`), with cmake, only the `llama-server` target, CPU only, static (one
file), no web UI (neither npm nor the prebuilt download: the server then serves its API
and no page), no curl/OpenSSL, `-DGGML_NATIVE=OFF` like the wheel. About as many minutes
as the wheel, once: the binary lands in `~/.cache/appliance/llama-server-0.3.36/`, and a
cached one is never rebuilt.

    python tests/harness/llama_cache.py            # ensure the wheel, install into this interpreter
    python tests/harness/llama_cache.py --wheel-only
    python tests/harness/llama_cache.py --server   # ensure the llama-server binary, print its path
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("APPLIANCE_CACHE_DIR", Path.home() / ".cache" / "appliance"))
WHEELS = CACHE / "wheels"
SERVER_DIR = CACHE / f"llama-server-{VERSION}"
SERVER = SERVER_DIR / "llama-server"
SDISTS = CACHE / "sdists"
# cmake flags of the llama-server build: the server target and what it links, nothing else.
SERVER_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained file to cache
    "-DGGML_NATIVE=OFF",  # no -march=native: the cache may move to another machine
    "-DGGML_CUDA=OFF", "-DGGML_VULKAN=OFF", "-DGGML_METAL=OFF", "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
    # The web UI: tools/ui would run npm (LLAMA_BUILD_UI) or download a prebuilt dist from
    # Hugging Face (LLAMA_USE_PREBUILT_UI); with both off it embeds an empty asset table.
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
]


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


def cached_server() -> Path | None:
    """The cached llama-server binary, or None when it has not been built."""
    return SERVER if os.access(SERVER, os.X_OK) else None


def ensure_server() -> Path:
    """The cached llama-server; built from the sdist's vendor/llama.cpp when missing."""
    SERVER_DIR.mkdir(parents=True, exist_ok=True)
    with open(SERVER_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if cached_server() is not None:
            return SERVER
        print(f"llama_cache: building llama-server from llama-cpp-python=={VERSION}'s "
              f"vendor/llama.cpp (minutes, once) into {SERVER_DIR}", flush=True)
        t0 = time.monotonic()
        sdist = ensure_sdist()
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", "2")
        # Built under the cache, not /tmp: outside any git checkout, so llama.cpp's
        # build-info does not take the enclosing repository's commit for its own.
        with tempfile.TemporaryDirectory(dir=SERVER_DIR) as tmp:
            with tarfile.open(sdist) as tar:
                tar.extractall(tmp, filter="data")
            (src,) = Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp")
            build = Path(tmp) / "build"
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen,
                            *SERVER_CMAKE_FLAGS], check=True)
            subprocess.run(["cmake", "--build", str(build), "--target", "llama-server",
                            "-j", jobs], check=True)
            built = build / "bin" / "llama-server"
            os.replace(built, SERVER_DIR / "llama-server.new")
            os.replace(SERVER_DIR / "llama-server.new", SERVER)  # whole or not at all
        print(f"llama_cache: llama-server built in {time.monotonic() - t0:.0f} s", flush=True)
        return SERVER


def ensure_sdist() -> Path:
    """llama-cpp-python's sdist (it vendors llama.cpp), downloaded once from the index."""
    SDISTS.mkdir(parents=True, exist_ok=True)
    found = sorted(SDISTS.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    with tempfile.TemporaryDirectory(dir=SDISTS) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:",
                        "--no-deps", f"llama-cpp-python=={VERSION}", "-d", tmp], check=True)
        (got,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        os.replace(got, SDISTS / got.name)
    return SDISTS / got.name


# --- the real servers the `llamacpp` tests run (tests/conftest.py's `real_server`) -------

N_CTX = 256  # the tiny model's context (tests/harness/make_gguf.py)


@dataclass(frozen=True)
class RealServer:
    """One real llama.cpp server as the llamacpp engine starts it."""

    name: str  # the test id: "llama-server" or "llama_cpp.server"
    command: str  # Engine__Command
    marker: bytes  # found in /proc/PID/cmdline of its process
    missing: str  # why it cannot run here ('' when it can)


def llama_server(binary: Path | None = None) -> RealServer:
    """llama.cpp's own server, the cached build: one thread (two cores shared by tests),
    the tiny model's context, `--jinja` for templates and tools, greedy (`--temp 0`: the
    tiny model's answers are the same every run; sampled, it now and then ends at once)."""
    binary = binary or cached_server()
    command = (f"{shlex.quote(str(binary or SERVER))} -m {{model}} --host 127.0.0.1 "
               f"--port {{port}} -c {N_CTX} -t 1 --jinja --temp 0 {{args}}")
    return RealServer("llama-server", command, b"llama-server",
                      "" if binary else "llama-server not built: run `make llama-server`")


def llama_cpp_python_server() -> RealServer:
    """llama-cpp-python's `python -m llama_cpp.server`, from this interpreter."""
    command = (f"{shlex.quote(sys.executable)} -m llama_cpp.server --model {{model}} "
               f"--host 127.0.0.1 --port {{port}} --n_ctx {N_CTX} {{args}}")
    found = importlib.util.find_spec("llama_cpp") is not None
    return RealServer("llama_cpp.server", command, b"llama_cpp.server",
                      "" if found else "llama-cpp-python not installed: run `make llamacpp-wheel`")


def real_servers() -> list[RealServer]:
    return [llama_server(), llama_cpp_python_server()]


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
    ap.add_argument("--server", action="store_true", help="ensure the llama-server binary")
    opts = ap.parse_args()
    if opts.server:
        print(ensure_server())
    elif opts.wheel_only:
        print(ensure_wheel())
    else:
        ensure_installed()
        print(f"llama_cache: llama-cpp-python {installed_version()} from {WHEELS}")


if __name__ == "__main__":
    main()
