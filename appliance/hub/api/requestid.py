"""`x-request-id`: the client's own when it sent a sane one, else one made here.

Theory of operation: the id names one request in the client's logs, the hub's audit line,
the node's and the engine's; the hub forwards it and returns it on every answer. A
client's value is untrusted: kept only when it is short printable ASCII without spaces
(so it cannot split a header or an audit line), else replaced. A made id is 128 random
bits in hex, from the process's own generator (seeded from the OS at start, reseeded in a
forked child): no system call per request; among 4 billion ids the chance that any two are
equal is about 2**-65.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

# Longest id kept as given: a UUID is 36, a W3C traceparent 55; 128 leaves room for both.
MAX_LEN = 128


_SANE = re.compile(rb"[\x21-\x7e]{1,%d}" % MAX_LEN)


def _sane(v: bytes) -> bool:
    return _SANE.fullmatch(v) is not None


def make() -> str:
    return f"{random.getrandbits(128):032x}"


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The id for a request with these ASGI headers."""
    for k, v in headers:
        if k == b"x-request-id" and _sane(v):
            return v.decode("ascii")
    return make()
