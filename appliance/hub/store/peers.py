"""Objects another hub holds: asked of that hub (several hubs on etcd).

Theory of operation: an object's id names the hub that made it and holds it (ids.py).
A route over one object (`/v1/files/{id}...`, batches, message batches, responses,
conversations) whose id names another hub is sent to that hub as it came -- method, path,
query, the caller's headers (its key), the body -- and the answer relayed back as it
arrives, so any hub answers for every object; a batch whose input file another hub holds
is made there, where its lines are. The hubs'
URLs are the cluster's (each hub's `hubs/NAME` key in etcd holds its Cluster__Url, else
Hub__Listen as bound; kept a lease after the key went, so a hub whose renewal came late
is still asked). A hub that is not running now (no key for a lease) or does not answer
is 503 `held_elsewhere` with Retry-After. A request a hub sent on carries
`x-appliance-from` and is answered where it lands, never sent on again (no loops).
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

import httpx

from appliance.bounds import echo
from appliance.http.asgi import BodyTooLarge, Receive, Scope, Send, read_body
from appliance.http.errors import ApiError
from appliance.hub.store import ids

if TYPE_CHECKING:
    from appliance.config import Config
    from appliance.hub.hub import Hub

# Sent on a request a hub passes to the hub that holds its object (its value: the sender).
FROM = b"x-appliance-from"
# Another hub that holds an object is asked again after about one lease's time.
RETRY_AFTER = 10.0
# Asking another hub: its connect on a LAN; a file's content may take a while to read.
TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=30.0, pool=5.0)
HOP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade",
       b"proxy-connection", b"trailer", b"content-length"}


def open_client(cfg: Config) -> httpx.AsyncClient:
    """The one client for the other hubs, opened with the cluster (hub/run.py): a client
    made per request loads the CA bundle each time (~0.2 s of CPU on a busy 2-core box)."""
    return httpx.AsyncClient(timeout=TIMEOUT, verify=cfg.hub.tls_ca or True, trust_env=False)


def own_url(cfg: Config, bound: tuple[str, int]) -> str:
    """This hub's URL as others reach it: Cluster__Url, else Hub__Listen as bound."""
    if cfg.cluster.url:
        return cfg.cluster.url.rstrip("/")
    host, port = bound
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if cfg.hub.tls_cert else 'http'}://{host}:{port}"


def elsewhere(hub: Hub, scope: Scope, oid: str, prefix: str) -> str | None:
    """The name (as ids give it) of the other hub holding `oid`, when this request is one
    to send there; else None (ours, not an id, one hub, or sent on to us already)."""
    holder = ids.holder(oid, prefix)
    if holder is None or holder == ids.safe_name(hub.cfg.hub_name()) or hub.cluster is None:
        return None
    if any(k == FROM for k, _ in scope["headers"]):
        return None
    return holder


def url_of(hub: Hub, holder: str) -> str | None:
    """Hub `holder`'s URL (a name as ids give it), or None while it is not running."""
    assert hub.cluster is not None
    return next((u for name, u in hub.cluster.hub_urls().items()
                 if ids.safe_name(name) == holder), None)


def sent_headers(hub: Hub, scope: Scope) -> list[tuple[bytes, bytes]]:
    """The caller's headers (its key) as another hub is asked, saying who sends them on."""
    headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP]
    headers.append((FROM, ids.safe_name(hub.cfg.hub_name()).encode()))
    return headers


def gone(oid: str, holder: str, why: str) -> ApiError:
    """503 `held_elsewhere`: another hub holds `oid` and cannot be asked now (`why`);
    asked again after about one lease's time."""
    return ApiError(503, "held_elsewhere", f"{echo(oid)} is held by hub {echo(holder)}, "
                    f"which {why}; ask again later", retry_after=RETRY_AFTER)


async def forward(hub: Hub, scope: Scope, receive: Receive, send: Send, oid: str,
                  holder: str) -> None:
    """Send the request to hub `holder` and relay its answer."""
    assert hub.peer_client is not None
    url = url_of(hub, holder)
    if url is None:
        raise gone(oid, holder, "is not running now")
    try:
        body = await read_body(receive, hub.cfg.hub.max_body_bytes)
    except BodyTooLarge:
        raise ApiError(413, "body_too_large", "body over Hub__MaxBodyBytes") from None
    target = url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
    qs = scope.get("query_string") or b""
    if qs:
        target += "?" + qs.decode("latin-1")
    headers = sent_headers(hub, scope)
    started = False
    try:
        async with hub.peer_client.stream(scope["method"], target, headers=headers,
                                          content=body) as resp:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw
                                    if k.lower() not in HOP]})
            started = True
            async for chunk in resp.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    except httpx.HTTPError as e:
        if started:  # the answer broke off: the client sees a cut answer, as from any hub
            raise
        raise gone(oid, holder, f"does not answer ({type(e).__name__})") from None
