"""The hub's own web page: `/ui/` and the small JSON feeds only it needs.

Theory of operation: the page is three static files (HTML, CSS, JavaScript) shipped in
the package -- no build step, no CDN, because edge boxes are often offline -- read once
from disk and served from memory. Only the names in `FILES` are served: a path is looked
up, never joined onto the file system. The page reads what an operator reads:
`/api/status`, `/admin/nodes`, and the feeds here, `/api/status/history` (15 minutes
of the hub's own counters, history.py), `/api/requests/recent` (the last request audit
records) and `/api/requests/slow` (the hour's slowest with their breakdown, both
observe/audit.py; also `appliance ctl slow`); the feeds take the admin key when one is
set, exactly like `/api/status`.
Actions go through the existing admin API, so they are audited there. The page itself is
open: it holds no data, and asks for the admin key (kept in the tab's sessionStorage)
only when the hub answers 401.

`GET /` is apiroutes.py's (Ollama's liveness answer; a browser, `Accept: text/html`, is
sent to `/ui/` there); `/ui` without the slash is sent to `/ui/` here.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from appliance.bounds import echo_path
from appliance.http.asgi import Scope, Send, send_json
from appliance.http.errors import ApiError
from appliance.http.respond import send_api_error
from appliance.hub.observe.audit import RECENT_MAX

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
FILES = {
    "index.html": b"text/html; charset=utf-8",
    "app.js": b"text/javascript; charset=utf-8",
    "style.css": b"text/css; charset=utf-8",
}
# The page loads only its own files and talks only to this hub.
PAGE_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-cache"),
]
FEEDS = ("/api/status/history", "/api/requests/recent", "/api/requests/slow")
_cache: dict[str, bytes] = {}


def _file(name: str) -> bytes:
    body = _cache.get(name)
    if body is None:
        with open(os.path.join(STATIC, name), "rb") as f:
            body = _cache[name] = f.read()
    return body


async def _redirect(send: Send, location: bytes) -> None:
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", location), (b"content-type",
                                                      b"text/plain; charset=utf-8")]})
    await send({"type": "http.response.body", "body": b"see " + location + b"\n"})


def _limit(scope: Scope) -> int:
    raw = parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("limit", [""])[0]
    try:
        return min(max(int(raw), 0), RECENT_MAX) if raw else 50
    except ValueError:
        return 50


async def handle(hub: Hub, scope: Scope, send: Send, admin_ok: Callable[[], bool]) -> bool:
    """Answer a /ui/ path or a feed; False: not ours.

    `admin_ok()` says whether the request carries the admin key (or none is set)."""
    path, method = scope["path"], scope["method"]
    if not (path == "/ui" or path.startswith("/ui/") or path in FEEDS):
        return False
    if method not in ("GET", "HEAD"):
        await send_api_error(send, "ollama",
                             ApiError(405, "method_not_allowed", f"{echo_path(path)} takes GET"))
        return True
    if path == "/ui":
        await _redirect(send, b"/ui/")
        return True
    if path in FEEDS:
        if not admin_ok():
            await send_api_error(send, "openai",
                                 ApiError(401, "invalid_api_key", "the admin key is required"))
            return True
        if path == FEEDS[0]:
            body = hub.history.payload()
        elif path == FEEDS[1]:
            body = hub.recent.payload(_limit(scope))
        else:
            body = hub.slow.payload(_limit(scope), time.time())
        await send_json(send, 200, body)
        return True
    name = path[len("/ui/"):] or "index.html"
    ctype = FILES.get(name)
    if ctype is None:
        await send_api_error(send, "ollama",
                             ApiError(404, "not_found", f"no file {name!r} in the page"))
        return True
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype),
                                                                          *PAGE_HEADERS]})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else _file(name)})
    return True
