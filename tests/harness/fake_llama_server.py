"""A stand-in for llama.cpp's servers, for tests of the `llamacpp` engine.

Theory of operation: it takes the arguments of both real servers -- `llama-server -m FILE
--port N [--host H]` and `python -m llama_cpp.server --model FILE --host H --port N` --
ignores the rest, and behaves like them on the paths the node uses: `/health` (503 while
"loading", then 200), `/v1/models`, `/v1/chat/completions` (also `stream: true` as SSE)
and `/v1/completions`. Plain stdlib, no appliance imports: it is a foreign process.

How a model misbehaves is chosen by its file name (or a line `architecture: NAME` in
the file, or `--fake-mode MODE`):
- `kev`: prints llama.cpp's own error lines for an unknown architecture to stderr, then
  a Python traceback as llama-cpp-python does, and exits 1 (as the real one does).
- `stall`: binds and answers `/health` with 503 "Loading model" forever.
- `chatty`: writes 1 MiB of log lines to stderr before it is healthy (a node that does
  not read the pipe continuously would block it).
- `crash`: becomes healthy, then exits with an error 0.5 s later.
- `python`: as `python -m llama_cpp.server`: no `/health` (404), and a `response_format`
  of type `json_schema` is a 422 in FastAPI's shape (llama-cpp-python takes only
  `json_object`, with a `schema`).
- a file that does not exist: llama.cpp's "failed to open GGUF file" line, exit 1.
`--health-delay S` (default 0.2) is how long it reports "loading" first.
`-np N` (`--parallel`, default 1): the slots `/props` says (`total_slots`; `--fake-total-slots`
says any number instead, an absurd one too) and `/slots` lists, busy while a completion
runs; `--fake-hold S` holds each completion that long at most (so a busy slot can be seen),
and `POST /fake/release` ends every hold, now and later (so a test waits on no clock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = "the quick brown fox jumps over the lazy dog".split()
LOCK = threading.Lock()
RELEASED = threading.Event()  # POST /fake/release: no completion is held any more


def _arch(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
    except OSError:
        return ""
    for line in head.splitlines():
        if line.startswith("architecture:"):
            return line.split(":", 1)[1].strip()
    return ""


def fail_kev(path: str) -> None:
    err = sys.stderr
    err.write(f"llama_model_loader: loaded meta data with 12 key-value pairs from {path}\n")
    err.write("llama_model_loader: - kv   0: general.architecture str = kev\n")
    err.write("llama_model_load: error loading model: error loading model architecture: "
              "unknown model architecture: 'kev'\n")
    err.write("llama_model_load_from_file_impl: failed to load model\n")
    err.write("Traceback (most recent call last):\n")
    err.write('  File "<frozen runpy>", line 198, in _run_module_as_main\n')
    err.write('  File "llama_cpp/llama.py", line 374, in __init__\n')
    err.write("    raise ValueError(f\"Failed to load model from file: {path_model}\")\n")
    err.write(f"ValueError: Failed to load model from file: {path}\n")
    err.flush()
    sys.exit(1)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-llama"
    state: dict = {}

    def log_message(self, fmt, *args):  # one line per request, like llama-server
        sys.stderr.write("srv  log_server_r: request: %s\n" % (fmt % args))

    def _json(self, status: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        ready = self.state["ready"]
        if self.path == "/health":
            if self.state.get("mode") == "python":
                return self._json(404, {"detail": "Not Found"})
            if not ready:
                return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            return self._json(200, {"status": "ok"})
        if self.path == "/props" and ready and self.state.get("mode") != "python":
            return self._json(200, {"total_slots": self.state["total_slots"],
                                    "model_path": self.state["model"],
                                    "modalities": {"vision": False}})
        if self.path == "/slots" and ready and self.state.get("mode") != "python":
            busy = self.state["busy"]
            return self._json(200, [{"id": i, "is_processing": i < busy, "n_ctx": 1024}
                                    for i in range(self.state["np"])])
        if self.path == "/v1/models":
            if not ready:
                return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
            return self._json(200, {"object": "list", "data": [
                {"id": self.state["alias"] or self.state["model"], "object": "model", "owned_by": "fake-llama",
                 "pid": os.getpid()}]})
        self._json(404, {"error": {"code": 404, "message": "File Not Found"}})

    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        try:
            req = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return self._json(400, {"error": {"code": 400, "message": "bad json"}})
        if self.path == "/fake/release":
            RELEASED.set()
            return self._json(200, {})
        if not self.state["ready"]:
            return self._json(503, {"error": {"code": 503, "message": "Loading model"}})
        chat = self.path == "/v1/chat/completions"
        rf = req.get("response_format")
        if self.state.get("mode") == "python" and isinstance(rf, dict) and rf.get(
                "type") not in (None, "text", "json_object"):
            return self._json(422, {"detail": [{"type": "literal_error",
                                                "loc": ["body", "response_format", "type"],
                                                "msg": "Input should be 'text' or 'json_object'"}]})
        if not chat and self.path != "/v1/completions":
            return self._json(404, {"error": {"code": 404, "message": "File Not Found"}})
        count = int(req.get("max_tokens") or 8)
        with LOCK:
            self.state["busy"] += 1
        try:
            if self.state["hold"]:
                RELEASED.wait(self.state["hold"])
            self._complete(chat, req, count)
        finally:
            with LOCK:
                self.state["busy"] -= 1

    def _complete(self, chat: bool, req: dict, count: int) -> None:
        words = [WORDS[i % len(WORDS)] for i in range(count)]
        model = req.get("model") or self.state["model"]
        if req.get("stream"):
            return self._stream(chat, model, words)
        text = " ".join(words)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        self._json(200, {"id": "fake-1", "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [choice],
                         "usage": {"prompt_tokens": 1, "completion_tokens": count,
                                   "total_tokens": count + 1}})

    def _stream(self, chat: bool, model: str, words: list[str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for i, w in enumerate(words):
            piece = w if i == 0 else " " + w
            last = i == len(words) - 1
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": "length"
                          if last else None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": "length" if last else None}
            ev = {"id": "fake-1", "object": "chat.completion.chunk" if chat else "text_completion",
                  "created": int(time.time()), "model": model, "choices": [choice]}
            self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--fake-mode", default="")
    ap.add_argument("--health-delay", type=float, default=0.2)
    ap.add_argument("-np", "--parallel", type=int, default=1)
    ap.add_argument("--fake-total-slots", type=int, default=None)
    ap.add_argument("--fake-hold", type=float, default=0.0)
    ap.add_argument("--version", action="store_true")
    ap.add_argument("-a", "--alias", default="")  # /v1/models lists it, as llama-server does
    opts, _rest = ap.parse_known_args(argv)
    if opts.version:
        sys.stderr.write("version: 0 (fake)\nbuilt with cc for x86_64-linux-gnu\n")
        return
    path, name = opts.model, os.path.basename(opts.model)
    mode = opts.fake_mode
    arch = _arch(path)
    for m in ("kev", "stall", "chatty", "crash"):
        if not mode and (m in name or arch == m):
            mode = m
    sys.stderr.write(f"build: 0 (fake) with cc; main: loading model {path}\n")
    if not os.path.exists(path):
        sys.stderr.write(
            f"gguf_init_from_file: failed to open GGUF file '{path}' (No such file or directory)\n")
        sys.stderr.write("llama_model_load_from_file_impl: failed to load model\n")
        sys.exit(1)
    if mode == "kev":
        time.sleep(0.1)
        fail_kev(path)
    Handler.state = {"ready": False, "model": path, "alias": opts.alias, "mode": mode, "np": opts.parallel,
                     "total_slots": opts.parallel if opts.fake_total_slots is None
                     else opts.fake_total_slots, "busy": 0, "hold": opts.fake_hold}
    srv = ThreadingHTTPServer((opts.host, opts.port), Handler)
    srv.daemon_threads = True
    sys.stderr.write(f"main: server is listening on http://{opts.host}:{opts.port}\n")
    sys.stderr.flush()

    def become_ready() -> None:
        if mode == "chatty":
            for i in range(16 * 1024):
                sys.stderr.write(f"load_tensors: tensor {i:08d} " + "x" * 40 + "\n")
            sys.stderr.flush()
        time.sleep(opts.health_delay)
        if mode == "stall":
            return
        Handler.state["ready"] = True
        sys.stderr.write("main: model loaded\n")
        sys.stderr.flush()
        if mode == "crash":
            time.sleep(0.5)
            sys.stderr.write("ggml_abort: GGML_ASSERT(ctx) failed: out of memory\n")
            sys.stderr.flush()
            os._exit(134)

    threading.Thread(target=become_ready, daemon=True).start()
    srv.serve_forever()


if __name__ == "__main__":
    main()
