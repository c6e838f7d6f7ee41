"""What every route over stored objects shares: who asks, which object, which page.

Theory of operation: an object belongs to the client name of the key that made it
(`owner`); the admin key (`Auth__AdminKey`, when set) may read, list, cancel and delete
every owner's objects but makes none; in anonymous mode every caller is the one owner
`anonymous`. An id that does not exist and an id of another owner get the same 404
`not_found` -- nothing tells them apart. An id that names another hub is that hub's:
stored.py sends the request there (hub/store/peers.py); one that reaches `find` anyway
(a hub that sent it on, one hub without a cluster) is 503 `held_elsewhere` with
Retry-After. With no store (`Store__Path` empty, or not openable) every such route is 501
`store_disabled`.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from appliance.bounds import echo
from appliance.http.asgi import Scope, bearer
from appliance.http.errors import ApiError
from appliance.hub.api.router import authenticate
from appliance.hub.store import ids, peers
from appliance.hub.store.db import Obj

if TYPE_CHECKING:
    from appliance.hub.hub import Hub
    from appliance.hub.store.store import Store

# The page bound of every list route (OpenAI's is 100 for batches, 10,000 for files).
MAX_PAGE = 100
DEFAULT_PAGE = 20


@dataclass
class Caller:
    owner: str | None  # None: the admin, who sees every owner's objects
    name: str  # whose new objects are (the client name; "admin" makes none)

    @property
    def admin(self) -> bool:
        return self.owner is None


def store_of(hub: Hub) -> Store:
    if hub.store is None:
        raise ApiError(501, "store_disabled", "this hub keeps no store (Store__Path is empty or "
                       "could not be opened): files, batches and stored objects are off")
    return hub.store


def caller(hub: Hub, scope: Scope) -> Caller:
    key = bearer(scope)
    admin = hub.cfg.auth.admin_key
    if admin and key and hmac.compare_digest(key.encode(), admin.encode()):
        return Caller(None, "admin")
    client = authenticate(hub.cfg.auth, key)
    return Caller(client.name, client.name)


def maker(c: Caller) -> str:
    """The owner of a new object; the admin key makes none (it is no client)."""
    if c.admin:
        raise ApiError(403, "permission_denied", "the admin key reads and deletes stored "
                       "objects; create them with a client key")
    return c.name


async def find(hub: Hub, store: Store, c: Caller, kind: str, prefix: str, oid: str) -> Obj:
    """The object, or 404 `not_found` -- for one that is absent or another key's alike."""
    o = await store.get(kind, oid, c.owner)
    if o is not None:
        return o
    holder = ids.holder(oid, prefix)
    if holder is not None and holder != ids.safe_name(hub.cfg.hub_name()):
        raise peers.gone(oid, holder, "this hub cannot reach now")
    raise ApiError(404, "not_found", f"No such {kind}: {echo(oid)!r}")


@dataclass
class PageAsk:
    after: str | None
    limit: int
    newest_first: bool
    query: dict[str, str]
    after_at: int | None = None  # the cursor's creation time, sent by a hub merging a list


# Sent with a list a hub asks of the others (peers.py): its cursor's creation time.
AFTER_AT = b"x-appliance-after-at"


def page_ask(scope: Scope, default_newest: bool = True) -> PageAsk:
    raw = scope.get("query_string", b"").decode("latin-1")
    q = {k: v[0] for k, v in parse_qs(raw, max_num_fields=20).items()}
    try:
        limit = int(q.get("limit", DEFAULT_PAGE))
    except ValueError:
        raise ApiError(400, "invalid_request", "limit must be an integer") from None
    if not 1 <= limit <= MAX_PAGE:
        raise ApiError(400, "invalid_request", f"limit must be 1..{MAX_PAGE}")
    order = q.get("order", "desc" if default_newest else "asc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "invalid_request", "order must be asc or desc")
    after_at = next((v for k, v in scope["headers"] if k == AFTER_AT), b"")
    return PageAsk(q.get("after") or q.get("after_id") or None, limit, order == "desc", q,
                   int(after_at) if after_at.isdigit() and len(after_at) < 16 else None)


def merge(pages: list[tuple[list[dict[str, Any]], bool]], limit: int,
          newest_first: bool) -> tuple[list[dict[str, Any]], bool]:
    """One page of a list from each hub's page after the same cursor: by (created_at, id)
    as each store orders them, the first `limit`, and whether any hub has more."""
    rows = sorted((d for data, _ in pages for d in data),
                  key=lambda d: (d["created_at"], d["id"]), reverse=newest_first)
    return rows[:limit], len(rows) > limit or any(more for _, more in pages)


def listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's list shape (Anthropic's has the same first_id/last_id/has_more)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}
