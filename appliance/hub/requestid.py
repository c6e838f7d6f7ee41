"""`x-request-id`: the client's own when it sent a sane one, else one made here.

Theory of operation: the id names one request in the client's logs, the hub's audit line,
the node's and the engine's; the hub forwards it and returns it on every answer. A
client's value is untrusted: kept only when it is short printable ASCII without spaces
(so it cannot split a header or an audit line), else replaced.
"""

from __future__ import annotations

import os

# Longest id kept as given: a UUID is 36, a W3C traceparent 55; 128 leaves room for both.
MAX_LEN = 128


def _sane(v: bytes) -> bool:
    return 0 < len(v) <= MAX_LEN and all(0x21 <= b <= 0x7E for b in v)


def make() -> str:
    return os.urandom(16).hex()


def request_id(headers) -> str:
    """The id for a request with these ASGI headers."""
    for k, v in headers:
        if k == b"x-request-id" and _sane(v):
            return v.decode("ascii")
    return make()
