"""The announcer: tells the hub (`Hub__Url`) that this node is here and where to dial it.

Theory of operation (DESIGN 2): the hub dials nodes; a node it was not configured with
learns of it from `POST {Hub__Url}/api/nodes/announce` (bearer node token, body
`wire.Announce(name, url)`). The announcement is repeated every `Node__AnnounceSeconds`,
so a restarted hub learns its fleet again without configuration. Announcing is never
fatal: a hub that is down or refuses is logged once when the outage starts and once when
it ends -- not once per attempt -- and tried again on the next round. With several hubs
(`Hub__Url` a comma-separated list, high availability) the node runs one loop per hub, so
a hub that is down never delays the announcement to another.
"""

from __future__ import annotations

import logging
import ssl

import httpx
import msgspec
import trio

from appliance.config import Config
from appliance.http.errors import describe
from appliance.wire import Announce

log = logging.getLogger(__name__)

_enc = msgspec.json.Encoder()


def hub_client(cfg: Config) -> httpx.AsyncClient:
    """The one client for the hub: verified against Node__TlsCa when set (and showing the
    node's certificate then); a hub on the LAN answers in well under 10 s."""
    verify: ssl.SSLContext | bool = True
    if cfg.node.tls_ca:
        verify = ssl.create_default_context(cafile=cfg.node.tls_ca)
        if cfg.node.tls_cert:
            verify.load_cert_chain(cfg.node.tls_cert, cfg.node.tls_key or None)
    return httpx.AsyncClient(verify=verify, timeout=httpx.Timeout(10.0))


async def announce_once(client: httpx.AsyncClient, hub_url: str, token: str,
                        me: Announce) -> str | None:
    """One announcement; None when the hub took it, else what went wrong."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    try:
        r = await client.post(f"{hub_url.rstrip('/')}/api/nodes/announce", content=_enc.encode(me),
                              headers=headers)
    except httpx.HTTPError as e:
        return describe(e)
    if r.status_code >= 300:
        return f"hub answered {r.status_code}: {r.text[:200]}"
    return None


async def announce_loop(client: httpx.AsyncClient, hub_url: str, token: str, me: Announce,
                        every: float,
                        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Announce now and every `every` seconds, until cancelled."""
    task_status.started()
    failing: str | None = None
    first = True
    while True:
        problem = await announce_once(client, hub_url, token, me)
        if problem is not None and (failing is None or first):
            log.warning(
                "cannot announce %s to the hub at %s: %s (retrying every %g s; logged once until "
                "it works)",
                        me.url, hub_url, problem, every)
        elif problem is None and (failing is not None or first):
            log.info("announced %s as %s to the hub at %s", me.name, me.url, hub_url)
        failing, first = problem, False
        await trio.sleep(every)
