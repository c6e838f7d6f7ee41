"""Object ids: `<prefix><hub>-<random>`, so any hub can tell which hub holds an object.

The prefixes are the ones the official clients show (`file-`, `batch_`, `resp_`, `conv_`,
`msg_`, `msgbatch_`); the random tail is 24 hex digits (96 bits: never guessed, never
repeated). `holder(id)` reads the hub's name back; a malformed id has none.
"""

from __future__ import annotations

import re
import secrets

TAIL = 24
PREFIXES = ("file-", "batch_req_", "batch_", "resp_", "conv_", "msg_", "msgbatch_", "item_")
# Hub names are host names or Hub__Name: kept to what is safe in a URL path segment.
_UNSAFE = re.compile(r"[^A-Za-z0-9.-]")
_ID = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def new(prefix: str, hub: str) -> str:
    return f"{prefix}{_UNSAFE.sub('-', hub)[:63]}-{secrets.token_hex(TAIL // 2)}"


def holder(oid: str, prefix: str) -> str | None:
    """The hub named in `oid`, or None when it is not one of our ids of this kind."""
    if not oid.startswith(prefix) or not _ID.fullmatch(oid):
        return None
    rest = oid[len(prefix):]
    if len(rest) < TAIL + 2 or rest[-TAIL - 1] != "-":
        return None
    return rest[:-TAIL - 1]


def safe_name(hub: str) -> str:
    return _UNSAFE.sub("-", hub)[:63]
