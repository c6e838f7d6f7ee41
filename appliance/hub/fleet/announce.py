"""Who may announce which node, and where the hub may dial it.

`POST /api/nodes/announce` is the one door through which a box outside the configuration
makes the hub open connections -- and send it prompts. An announcement passes, in order:

1. a token: the shared `Auth__NodeToken`, or a per-node `Auth__Nodes__N__Token`, which
   may announce only its own name (and a name that has a per-node token cannot be
   announced with the shared one). No token configured at all: no announcements (401);
2. the shape: a DNS-label-like name, an `http(s)://host:port` URL with no path, query,
   fragment or credentials (400);
3. identity: a name that belongs to a static node, or to an announced node the hub can
   reach, is not taken by another URL (409 `node_name_taken`); a node that is really
   moving is lost first. A per-node token proves the box is that node: it may re-point;
4. room: at most `Hub__MaxNodes` nodes (503);
5. the network: every address the host resolves to lies in `Hub__NodeNetworks` and is
   not link-local (403). Static nodes are trusted and never checked.

Everything but the resolution is plain synchronous code (`check`); the app resolves with
trio and calls `check_addresses`. This module never dials a node.
"""

from __future__ import annotations

import hmac
import ipaddress
from urllib.parse import urlsplit

from appliance.bounds import ECHO_CHARS, echo
from appliance.config import NODE_NAME_RULE, AuthConfig, valid_node_name
from appliance.http.errors import ApiError
from appliance.hub.fleet.nodes import NodeHandle

# Retry-After for a full fleet: a ghost is forgotten within Hub__ForgetNodeSeconds anyway.
FULL_RETRY_AFTER = 60.0


def cut(text: str, n: int = ECHO_CHARS) -> str:
    """Names and URLs echoed in refusals are cut (a 60 KB name is not echoed whole)."""
    return echo(text, n)


def check_bearer(auth: AuthConfig, token: str) -> None:
    """401 unless `token` is one of the configured node tokens: checked from the head alone,
    before a byte of the body is read (a token-less head must not hold a connection)."""
    known = [c.token for c in auth.nodes] + ([auth.node_token] if auth.node_token else [])
    if not known:
        raise ApiError(401, "invalid_node_token",
                       "this hub accepts no announcements: set Auth__NodeToken (or "
                       "Auth__Nodes__N__Token) on hub and node")
    given = token.encode()
    # Every token compared (no early exit): the time taken says nothing of which matched.
    if not sum(hmac.compare_digest(given, k.encode()) for k in known):
        raise ApiError(401, "invalid_node_token", "the node token does not match")


def authorize(auth: AuthConfig, token: str, name: str) -> bool:
    """True when `token` may announce `name`; raises 401 when announcements are off."""
    per_node = {c.name: c.token for c in auth.nodes}
    if not auth.node_token and not per_node:
        raise ApiError(401, "invalid_node_token",
                         "this hub accepts no announcements: set Auth__NodeToken (or "
                         "Auth__Nodes__N__Token) on hub and node")
    given = token.encode()
    own = per_node.get(name)
    if own is not None:
        if hmac.compare_digest(given, own.encode()):
            return True
    elif auth.node_token and hmac.compare_digest(given, auth.node_token.encode()):
        return False
    raise ApiError(401, "invalid_node_token", "the node token does not match")


def check_shape(name: str, url: str) -> tuple[str, int]:
    """(host, port) of a well-formed announcement; ApiError 400 otherwise."""
    if not valid_node_name(name):
        raise ApiError(400, "invalid_request",
                       f"bad announcement: name {cut(name)!r}: {NODE_NAME_RULE}")
    bad = f"bad announcement: url {cut(url)!r} is not http(s)://HOST:PORT"
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        raise ApiError(400, "invalid_request", bad + " (bad port)") from None
    if u.scheme not in ("http", "https") or not u.hostname or port is None:
        raise ApiError(400, "invalid_request", bad)
    extra = u.query or u.fragment or u.username is not None or u.password is not None
    if u.path not in ("", "/") or extra:
        raise ApiError(400, "invalid_request", bad + " (no path, query or credentials)")
    if len(url) > 300:
        raise ApiError(400, "invalid_request", bad + " (too long)")
    return u.hostname, port


def check_identity(existing: NodeHandle | None, url: str, proven: bool, count: int,
                   max_nodes: int) -> None:
    """`existing`: the node handle of that name or None. 409 when the name is taken, 503
    when full."""
    if existing is None:
        if count >= max_nodes:
            raise ApiError(503, "too_many_nodes",
                           f"the hub knows {count} nodes (Hub__MaxNodes={max_nodes})",
                             retry_after=FULL_RETRY_AFTER)
        return
    if existing.url == url.rstrip("/"):
        return
    if existing.static:
        raise ApiError(409, "node_name_taken",
                       f"node {existing.name!r} is configured statically at another URL")
    if proven:
        return
    if existing.status() != "lost":
        raise ApiError(409, "node_name_taken",
                         f"node {existing.name!r} is connected at another URL; a moving node is "
                         "lost first")


def _networks(cidrs: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def check_addresses(host: str, addresses: list[str], cidrs: list[str]) -> None:
    """Every address `host` resolved to must lie in `cidrs` and not be link-local (403)."""
    nets = _networks(cidrs)
    if not addresses:
        raise ApiError(400, "invalid_request",
                       f"bad announcement: host {cut(host)!r} does not resolve")
    for a in addresses:
        ip = ipaddress.ip_address(a.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        listed = any(ip in n for n in nets if n.version == ip.version)
        if ip.is_link_local or ip.is_multicast or ip.is_unspecified or not listed:
            raise ApiError(403, "node_network_refused",
                             f"host {cut(host)!r} resolves to {ip}, outside Hub__NodeNetworks "
                             f"({','.join(cidrs)})")
