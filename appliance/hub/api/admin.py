"""The admin API (`/admin/...`, admin key checked by the app before this is called).

Theory of operation: what `appliance ctl` talks to. Reads are computed from live state
(the registry and the control plane) on each call; writes are the operator's levers --
retry a parked model, cordon a node (the hub stops routing to it), pause a node (the
node's own control API: it refuses new work). Every write is an audit line.

`GET /admin/status` is the deploy gate: each model counted against what it should have now
(always-on replicas; for an on-demand model that was asked for, at least one), so an
asked-for model that fitted nowhere reads unsatisfied; a parked model is unsatisfied until
retried; a lost node is a problem. `satisfied` is false while any of that holds, and
`problems` says why in words an operator paged at night can act on.

Model names hold `/` and `:`: path segments are percent-decoded one by one from the raw
path, and an unencoded `/` inside a model name is tolerated.
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from appliance.bounds import echo
from appliance.client.upstream import UpstreamError
from appliance.http.asgi import Receive, Scope, Send, send_json
from appliance.http.errors import ApiError, api_of
from appliance.http.respond import send_api_error
from appliance.hub.api.status import tenants_status, with_routing
from appliance.hub.cluster.etcd import EtcdError
from appliance.hub.decide.cost import CostRouter
from appliance.hub.fleet.nodes import NodeHandle
from appliance.hub.fleet.ops import NodeRefused

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

log = logging.getLogger(__name__)

NODE_ACTIONS = ("cordon", "uncordon", "pause", "resume")


def node_row(h: NodeHandle, cost: CostRouter | None = None) -> dict[str, Any]:
    st = h.state
    by_state: dict[str, list[str]] = {"ready": [], "loading": [], "failed": [], "available": []}
    for m in st.models if st is not None else []:
        by_state.setdefault(m.state, []).append(m.name)
    return {
        "name": h.name, "url": h.url, "status": h.status(), "cordoned": h.cordoned,
        "paused": bool(st and st.paused), "lost_reason": "" if h.connected else h.lost_reason,
        "over_limits_reason": st.over_limits_reason if st is not None else "",
        "engines": [{"kind": e.kind, "version": e.version} for e in st.engines] if st is not None
        else [],
        "memory_total_mb": st.memory_total_mb if st is not None else None,
        "memory_used_mb": st.memory_used_mb if st is not None else None,
        "max_concurrency": st.max_concurrency if st is not None else None,
        "in_flight": h.in_flight_total, "models": by_state,
        # ready replicas the node says do not generate, and why (its probes)
        "unhealthy": {m.name: h.unhealthy(m.name) for m in (st.models if st is not None else [])
                      if h.unhealthy(m.name)},
        # HA fencing: the leader epoch the node keeps, and why it refuses this leader's.
        "epoch": h.epoch, "fenced": h.fenced,
        # per ready model: places, the engine's busy slots, predicted wait, home waits
        "load": {name: cost.load_of(h, name) for name in by_state["ready"]}
        if cost is not None else {},
    }


def nodes(hub: Hub) -> list[dict[str, Any]]:
    return [node_row(h, hub.admission.cost)
            for h in sorted(hub.registry.nodes.values(), key=lambda h: h.name) if not h.removed]


def status(hub: Hub) -> dict[str, Any]:
    models = with_routing(hub.admission.affinity, hub.control.model_details(),
                          hub.admission.cost)
    rows = nodes(hub)
    problems = []
    for m in models:
        if m["parked"]:
            problems.append(
                f"model {m['name']} is parked after {m['consecutive_start_failures']} failed "
                "starts;"
                            f" last error: {m['last_error']} (fix it, then `appliance ctl retry "
                            f"{m['name']}`)")
        elif not m["satisfied"]:
            why = m["reason"] or ("loading" if m["loading"] else "nothing ready")
            problems.append(f"model {m['name']} has {m['ready']} of {m['desired']} ready: {why}")
    for n in rows:
        if n["status"] == "lost":
            problems.append(f"node {n['name']} is lost: {n['lost_reason']}")
    if hub.audit is not None and hub.audit.failing:
        problems.append(f"audit lines are not being written to {hub.audit.path or 'stdout'}: "
                        f"{hub.audit.last_error} ({hub.audit.write_errors} lost so far)")
    out: dict[str, Any] = {"satisfied": not problems, "problems": problems, "models": models,
                           "nodes": rows}
    if (tenants := tenants_status(hub)) is not None:
        out["tenants"] = tenants
    if (cluster := getattr(hub, "cluster", None)) is not None:
        out["cluster"] = cstatus = cluster.status()
        if not cstatus["leader"]:
            problems.append("no hub leads the fleet: models cannot be placed (is etcd reachable?)")
            out["satisfied"] = False
    return out


def _segments(scope: Scope) -> list[str]:
    raw = scope.get("raw_path") or scope["path"].encode()
    path = raw.decode("latin-1").split("?", 1)[0]
    return [urllib.parse.unquote(s) for s in path.strip("/").split("/")]


def _event(hub: Hub, action: str, **fields: Any) -> None:
    if hub.audit is not None:
        hub.audit.event("admin", actor="admin", action=action, **fields)


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send) -> None:
    """One /admin/ request; a refusal is an ApiError, answered in the path's shape."""
    try:
        await _handle(hub, scope, send)
    except ApiError as e:
        await send_api_error(send, api_of(scope["path"]), e)


async def _handle(hub: Hub, scope: Scope, send: Send) -> None:
    method, segs = scope["method"], _segments(scope)
    rest = segs[1:]  # after "admin"
    if rest in (["status"], ["models"], ["nodes"]):
        if method != "GET":
            raise ApiError(405, "method_not_allowed", f"{method} not allowed; use GET")
        views: dict[str, Callable[[], dict[str, Any]]] = {
            "status": lambda: status(hub),
            "models": lambda: {"models": hub.control.model_details()},
            "nodes": lambda: {"nodes": nodes(hub)}}
        body = views[rest[0]]()
        return await send_json(send, 200, body)
    if len(rest) >= 3 and rest[0] == "models" and rest[-1] == "retry":
        if method != "POST":
            raise ApiError(405, "method_not_allowed", f"{method} not allowed; use POST")
        model = "/".join(rest[1:-1])
        parked = bool(hub.control.core.health.get(model) and hub.control.core.health[model].parked)
        if not hub.control.known(model):
            raise ApiError(404, "model_not_found", f"model {echo(model)!r} not found")
        if (cluster := getattr(hub, "cluster", None)) is not None and not cluster.leading:
            try:  # a follower: the leader applies it (and every hub sees the result)
                await cluster.request_retry(model)
            except EtcdError as e:
                raise ApiError(503, "no_leader",
                               f"no leader to retry {echo(model)!r}: etcd: {e}") from None
        elif not hub.control.retry(model):
            raise ApiError(404, "model_not_found", f"model {echo(model)!r} not found")
        _event(hub, "retry", model=model, was_parked=parked)
        return await send_json(send, 200, {"model": model, "retried": True, "was_parked": parked})
    if len(rest) == 2 and rest[0] == "nodes":
        if method != "DELETE":
            raise ApiError(405, "method_not_allowed",
                           f"{method} not allowed; use DELETE to forget the node")
        return await _forget(hub, rest[1], send)
    if len(rest) == 3 and rest[0] == "nodes" and rest[2] in NODE_ACTIONS:
        if method != "POST":
            raise ApiError(405, "method_not_allowed", f"{method} not allowed; use POST")
        return await _node_action(hub, rest[1], rest[2], send)
    raise ApiError(404, "not_found", "no such admin path; see GET /admin/status, /admin/models, "
                   "/admin/nodes, POST /admin/models/MODEL/retry, "
                   "/admin/nodes/NODE/{cordon,uncordon,pause,resume}, DELETE /admin/nodes/NODE")


async def _forget(hub: Hub, name: str, send: Send) -> None:
    """Drop a node now (`ctl forget`): an announced one comes back only by announcing again,
    a static one at the next reload or start."""
    h = hub.registry.nodes.get(name)
    if h is None or h.removed:
        raise ApiError(404, "not_found", f"node {echo(name)!r} not found")
    hub.registry.forget(h)
    log.warning("node %s at %s forgotten by an operator", name, h.url)
    if (cluster := getattr(hub, "cluster",
                           None)) is not None:  # every hub drops it (until it announces again)
        try:
            await cluster.forgot(name)
        except EtcdError as e:
            log.warning("node %s forgotten here only, not on the other hubs: etcd: %s", name, e)
    _event(hub, "forget", node=name, url=h.url, static=h.static)
    await send_json(send, 200, {"node": name, "action": "forget", "status": "forgotten"})


async def _node_action(hub: Hub, name: str, action: str, send: Send) -> None:
    h = hub.registry.nodes.get(name)
    if h is None or h.removed:
        raise ApiError(404, "not_found", f"node {echo(name)!r} not found")
    if action in ("cordon", "uncordon"):
        h.cordoned = action == "cordon"
        log.warning("node %s %sed by an operator", name, action)
        hub.registry.changed()
        if (cluster := getattr(hub, "cluster",
                               None)) is not None:  # every hub routes by the same cordons
            try:
                await cluster.set_cordon(name, h.cordoned)
            except EtcdError as e:
                raise ApiError(503, "cluster_unavailable",
                               f"node {name} {action}ed on this hub only: etcd: {e}") from None
    else:
        try:
            await hub.control.ops.control(h, action)
        except UpstreamError as e:
            raise ApiError(502, "node_error", f"node {name} did not answer {action}: "
                           f"{type(e).__name__}: {e}") from None
        except NodeRefused as e:
            raise ApiError(502, "node_error", f"node {name} refused {action}: {e}") from None
        log.warning("node %s %sd by an operator", name, action)
    _event(hub, action, node=name)
    await send_json(send, 200, {"node": name, "action": action, "status": h.status()})
