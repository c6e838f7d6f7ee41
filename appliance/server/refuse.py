"""The server's own refusals (408, 400, 413, 414, 431, 503 `busy` ...) as whole answers that
close the connection, rendered by the one renderer (appliance/http/errors.py `render`) in
the shape of the API the request came in on (`api_of`).

Theory of operation: the connection (appliance/server/connection.py) refuses what breaks a
listener rule before or beside the app; the client still gets an error its SDK can read.
A path the server echoes is cut to PATH_ECHO characters (appliance/bounds.py).
"""

from __future__ import annotations

from appliance.h1.state import STATUS_LINES, date_header, status_line
from appliance.http.errors import ApiError, api_of, render


def refusal_answer(path: str, e: ApiError) -> bytes:
    """The whole answer to a request on `path` refused with `e`; the connection closes."""
    r = render(e, api_of(path), [(b"connection", b"close")])
    return ((STATUS_LINES.get(r.status) or status_line(r.status)) + date_header()
            + b"".join(k + b": " + v + b"\r\n" for k, v in r.headers) + b"\r\n" + r.body)
