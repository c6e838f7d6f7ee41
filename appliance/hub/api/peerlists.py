"""A list route over every running hub's objects (several hubs on etcd).

Theory of operation: each hub's store holds the objects it made, so `GET /v1/files` and
`GET /v1/batches` asked of one hub ask every other running hub for the same page at once
(the caller's key, `x-appliance-from`: a hub asked so answers its own objects only) and
merge the pages by (created_at, id) as each store orders them (objects.merge). The cursor
(`after`, an id) names the hub that holds it: its creation time (read here, or asked of
that hub) goes to the others as `x-appliance-after-at`, so each store places a cursor it
does not hold. A hub that does not answer within LIST_SECONDS is left out of the page (its
objects are listed again once it answers); a cursor whose hub does not answer is 503
`held_elsewhere`, as any of its ids.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import httpx
import trio

from appliance.http.asgi import Scope
from appliance.hub.api.objects import AFTER_AT, MAX_PAGE, PageAsk, merge
from appliance.hub.store import ids
from appliance.hub.store.peers import FROM, gone, sent_headers, url_of

if TYPE_CHECKING:
    from appliance.hub.hub import Hub
    from appliance.hub.store.store import Store

log = logging.getLogger(__name__)

# The other hubs' pages are waited for this long (a LAN answer takes milliseconds; a hub
# that takes longer is left out rather than holding the list up to its read timeout).
LIST_SECONDS = 5.0


def merges(hub: Hub, scope: Scope) -> bool:
    """Several hubs, and not asked by one of them (that one merges)."""
    return hub.cluster is not None and not any(k == FROM for k, _ in scope["headers"])


async def cursor_at(hub: Hub, scope: Scope, ask: PageAsk, store: Store, kind: str,
                    prefix: str, owner: str | None) -> int | None:
    """The creation time of the page's cursor, which every store places by (each holds
    only its own objects): sent by the hub that merges, read from this store, or asked
    of the hub that holds it; None: no cursor, one unknown, or a list not merged."""
    if ask.after_at is not None or not ask.after or not merges(hub, scope):
        return ask.after_at
    holder = ids.holder(ask.after, prefix)
    if holder is None or holder == ids.safe_name(hub.cfg.hub_name()):
        o = await store.get(kind, ask.after, owner)
        return o.created_at if o is not None else None
    url = url_of(hub, holder)
    if url is None:
        raise gone(ask.after, holder, "is not running now")
    assert hub.peer_client is not None
    try:
        with trio.fail_after(LIST_SECONDS):
            r = await hub.peer_client.get(f"{url}{scope['path']}/{ask.after}",
                                          headers=sent_headers(hub, scope))
        at = r.json().get("created_at") if r.status_code == 200 else None
    except (httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError) as e:
        raise gone(ask.after, holder, f"does not answer ({type(e).__name__})") from None
    if r.status_code == 404:
        return None  # not the caller's: placed as an unknown cursor is (from the start)
    if not isinstance(at, int):
        raise gone(ask.after, holder, f"does not answer ({r.status_code})")
    return at


async def merged(hub: Hub, scope: Scope, ask: PageAsk, at: int | None,
                 data: list[dict[str, Any]], more: bool) -> tuple[list[dict[str, Any]], bool]:
    """This hub's page `data` merged with every other running hub's (when this list
    `merges`): the page the client gets, and whether there is more."""
    if not merges(hub, scope):
        return data, more
    assert hub.cluster is not None and hub.peer_client is not None
    client = hub.peer_client
    me = ids.safe_name(hub.cfg.hub_name())
    headers = sent_headers(hub, scope)
    if at is not None:
        headers.append((AFTER_AT, str(at).encode()))
    target = scope["path"] + ("?" + scope["query_string"].decode("latin-1")
                              if scope.get("query_string") else "")
    pages = [(data, more)]

    async def one(name: str, url: str) -> None:
        try:
            r = await client.get(url + target, headers=headers)
            got = r.json() if r.status_code == 200 else None
            if not isinstance(got, dict) or not _rows(got.get("data")):
                raise ValueError(f"answered {r.status_code} with no list")
            pages.append((got["data"], got.get("has_more") is True))
        except (httpx.HTTPError, ValueError) as e:
            log.warning("hub %s left out of a list: %s", name, e)

    with trio.move_on_after(LIST_SECONDS) as waited:
        async with trio.open_nursery() as nursery:
            for name, url in hub.cluster.hub_urls().items():
                if ids.safe_name(name) != me:
                    nursery.start_soon(one, name, url)
    if waited.cancelled_caught:
        log.warning("a hub left out of a list: no answer within %g s", LIST_SECONDS)
    return merge(pages, ask.limit, ask.newest_first)


def _rows(rows: Any) -> bool:
    """A list page's data as merge reads it (another hub's answer: checked, not trusted)."""
    return isinstance(rows, list) and len(rows) <= MAX_PAGE and all(
        isinstance(d, dict) and isinstance(d.get("created_at"), int)
        and isinstance(d.get("id"), str) for d in rows)
