"""An engine's refusal, as the hub's own error in the client's API shape.

Theory of operation: a node answers a status of 400 or more with whatever its engine
wrote -- an OpenAI error object, Ollama's `{"error": ...}`, FastAPI's `{"detail": [...]}`,
a Python traceback as text (llama-cpp-python's 500s), an HTML page from a proxy, or
garbage. The hub never passes those bytes on: `ErrorConverter` buffers at most
ERROR_BODY_LIMIT of them and answers the hub's own error (appliance.http.errors.error_body)
with the same status and the engine's words cut to one line (`engine_message`): the
exception line of a traceback, the title of an HTML page, the first line of anything
else; file paths replaced by `<path>`, at most MESSAGE_LIMIT characters. A code the body
names (`error.code`, a plain token such as the node's `model_not_found`) is kept; else
the status says it. Nothing here does I/O.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from appliance.http.errors import error_body
from appliance.hub.translate.usage import Usage

# An engine's error body worth quoting is short; more is cut (and never buffered past it).
ERROR_BODY_LIMIT = 64 * 1024
# One line a person reads in a client's exception: OpenAI's own messages stay under ~300.
MESSAGE_LIMIT = 300
TRACEBACK = "Traceback (most recent call last):"
# A file path: absolute (POSIX, from the root or home) or a Windows drive path, with at least
# one folder. Not the path of a URL (the slash follows a host) and not an API route.
_PATH = re.compile(r"(?<![\w:/.~-])~?/(?!v1/|api/)(?:[^\s/'\"<>]+/)+[^\s'\"<>,;:)]*"
                   r"|\b[A-Za-z]:\\[^\s'\"<>]+")
_TITLE = re.compile(rb"<title[^>]*>(.*?)</title>", re.I | re.S)
_TAG = re.compile(r"<[^>]*>")
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def _first_line(text: str) -> str:
    """The line of `text` that says what went wrong: a traceback's exception line, else
    the first line with something on it."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if any(ln.strip() == TRACEBACK for ln in lines):
        # The exception line is the last one at the left margin after the traceback.
        i = max(i for i, ln in enumerate(lines) if ln.strip() == TRACEBACK)
        after = [ln for ln in lines[i + 1:] if not ln[:1].isspace()]
        return after[-1] if after else ""
    return lines[0] if lines else ""


def clean(text: str) -> str:
    """One bounded line, no paths, no traceback."""
    line = _first_line(text)
    line = _PATH.sub("<path>", _CONTROL.sub(" ", line)).strip()
    if "Traceback" in line or 'File "' in line:
        return ""
    if len(line) > MESSAGE_LIMIT:
        line = line[:MESSAGE_LIMIT - 1].rstrip() + "…"
    return line


def _detail(d: Any) -> str:
    """FastAPI's validation detail (a list of {loc, msg}) as one line."""
    if isinstance(d, list) and d and isinstance(d[0], dict):
        loc = d[0].get("loc")
        where = ".".join(str(x) for x in loc) if isinstance(loc, list) else ""
        msg = d[0].get("msg")
        return f"{where}: {msg}" if where and isinstance(msg, str) else str(msg or "")
    return d if isinstance(d, str) else ""


def _words(body: bytes) -> tuple[str, str | None]:
    """(the engine's words, the code it names) before cleaning."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            code = err.get("code")
            msg = err.get("message")
            return (msg if isinstance(msg, str) else ""), code if isinstance(code, str) else None
        if isinstance(err, str):
            return err, None
        if "detail" in obj:
            return _detail(obj["detail"]), None
        msg = obj.get("message")
        return (msg if isinstance(msg, str) else ""), None
    if isinstance(obj, str):
        return obj, None
    if obj is not None:
        return "", None
    text = body.decode("utf-8", "replace")
    if text.lstrip()[:1] == "<":  # HTML (a proxy's or a framework's error page)
        title = _TITLE.search(body)
        text = title.group(1).decode("utf-8", "replace") if title else _TAG.sub(" ", text)
        text = " ".join(text.split())
    return text, None


def engine_message(status: int, body: bytes) -> str:
    """The engine's words in its error body, whatever its shape, as one clean line."""
    return clean(_words(body)[0]) or f"the engine answered {status}"


def engine_error(status: int, body: bytes) -> tuple[str, str]:
    """(code, message) of an engine's error answer."""
    words, code = _words(body)
    if code is None or not _CODE.fullmatch(code):
        code = "engine_error" if status >= 500 else "invalid_request"
        if status == 404:
            code = "model_not_found"
    return code, clean(words) or f"the engine answered {status}"


class ErrorConverter:
    """An engine's answer of status >= 400, rendered in the client's API shape."""

    content_type = b"application/json"

    def __init__(self, api: str, status: int) -> None:
        self.api = api
        self.status = status
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if len(self._buf) < ERROR_BODY_LIMIT:
            self._buf += chunk[:ERROR_BODY_LIMIT - len(self._buf)]
        return b""

    def end(self) -> bytes:
        code, message = engine_error(self.status, self._buf)
        return error_body(self.api, self.status, code, message)

    def usage(self) -> Usage | None:
        return None  # nothing was generated
