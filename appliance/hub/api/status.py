"""What the hub says about itself: /api/status, the model lists, /api/ps.

Theory of operation: every payload here is derived on request from the registry, the
control plane and admission -- nothing is cached, so nothing goes stale. The keys of
/api/status are the contract of DESIGN 9; `priority` appears only while priority is on.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.hub.decide.affinity import Affinity
from appliance.hub.decide.cost import CostRouter
from appliance.hub.fleet.nodes import NodeHandle
from appliance.wire import HEALTHY, UNHEALTHY, ModelMeta

if TYPE_CHECKING:
    from appliance.hub.hub import Hub

MiB = 1024 * 1024
# A model whose engine names no date of its own is as new as this hub.
STARTED_AT = time.time()


def node_entry(h: NodeHandle, cost: CostRouter | None = None) -> dict[str, Any]:
    st = h.state
    models = []
    if st is not None:
        # health: "ok", or "replica_unhealthy" with why (the node's generation probes);
        # with `cost`: places, the engine's busy slots, predicted wait, home waits here
        models = [{"name": m.name, "state": m.state, "size_mb": m.size_mb,
                   "in_flight": h.in_flight.get(m.name, 0), "last_error": m.last_error,
                   "health": UNHEALTHY if h.unhealthy(m.name) else HEALTHY,
                   "health_error": h.unhealthy(m.name),
                   **(cost.load_of(h, m.name) if cost is not None else {})}
                  for m in st.models]
    return {
        "name": h.name,
        "url": h.url,
        "status": h.status(),
        "max_concurrency": st.max_concurrency if st is not None else None,
        "in_flight": h.in_flight_total,
        "models": models,
        # HA fencing (0 and "" with one hub): the leader epoch the node keeps, and why it
        # refuses this leader's epoch (a forged or dead one it still holds).
        "epoch": h.epoch,
        "fenced": h.fenced,
        # Hubs that gave the node orders without etcd lately: two or more fight over it.
        "hubs": list(st.hubs) if st is not None else [],
    }


def with_routing(affinity: Affinity, models: list[dict[str, Any]],
                 cost: CostRouter | None = None) -> list[dict[str, Any]]:
    """Each model's `routing`: how its requests were placed (session, prefix, spread) and
    the engines' cache hit ratio (hub/decide/affinity.py); with `cost`, its home waits by
    outcome (hub/decide/home.py)."""
    homes = cost.queues.by_model() if cost is not None else {}
    for m in models:
        m["routing"] = affinity.status(m["name"])
        if cost is not None:
            m["routing"]["home_waits"] = homes.get(m["name"], {})
    return models


def status_payload(hub: Hub) -> dict[str, Any]:
    out = {
        "version": __version__,
        "nodes": [node_entry(h, hub.admission.cost) for h in hub.registry.nodes.values()],
        "models": with_routing(hub.admission.affinity, hub.control.models_status(),
                               hub.admission.cost),
        "audit": {"path": hub.audit.path or "stdout", "write_errors": hub.audit.write_errors,
                  "last_error": hub.audit.last_error, "failing": hub.audit.failing},
    }
    if (cluster := getattr(hub, "cluster",
                           None)) is not None:  # several hubs: who leads, by which epoch
        out["cluster"] = cluster.status()
    if (ws := getattr(hub, "workers", None)) is not None:  # Hub__Workers>1: every process
        out["workers"] = ws.status()
    block = hub.admission.status_block()
    if block is not None:
        out["priority"] = block
    if (tenants := tenants_status(hub)) is not None:
        out["tenants"] = tenants
    if (batches := getattr(hub, "batches", None)) is not None:  # with a store: running ones
        out["batches"] = batches.progress()
    return out


def tenants_status(hub: Hub) -> dict[str, Any] | None:
    """Per key (hub/decide/limits.py): limits, use this minute and the last 24 h, in
    flight, queued, tokens served and the share of them. None for a hub without limits
    (a test's stand-in)."""
    limiter = getattr(hub, "tenants", None)
    if limiter is None:
        return None
    status: dict[str, Any] = limiter.status(time.time(), hub.admission.core.queued())
    return status


def _size_bytes(hub: Hub, model: str) -> int:
    for h in hub.registry.nodes.values():
        if h.state is not None:
            m = h.state.model(model)
            if m is not None and m.size_mb:
                return m.size_mb * MiB
    return 0


def model_meta(hub: Hub, model: str) -> ModelMeta | None:
    """What an engine said about `model` (wire.ModelMeta), from the first node that says it."""
    best: ModelMeta | None = None
    for h in hub.registry.nodes.values():
        if h.state is not None:
            m = h.state.model(model)
            if m is not None and m.meta is not None:
                if m.meta.context_length:
                    return m.meta
                best = best or m.meta
    return best


def digest(hub: Hub, model: str, meta: ModelMeta | None) -> str:
    """The engine's digest; for a model no engine describes yet, a stable stand-in (the
    sha256 of its name and catalog source), so clients that key on it never see ""."""
    if meta is not None and meta.digest:
        return meta.digest
    spec = hub.control.core.spec(model)
    return hashlib.sha256(f"{model}\n{spec.source}".encode()).hexdigest()


def details(meta: ModelMeta | None) -> dict[str, Any]:
    if meta is None:
        return {"parent_model": "", "format": "", "family": "", "families": None,
                "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": meta.format, "family": meta.family,
            "families": meta.families,
            "parameter_size": meta.parameter_size, "quantization_level": meta.quantization_level}


def _expires_at(hub: Hub, model: str) -> str:
    """When an idle model will be unloaded, as Ollama's /api/ps says it; far ahead for
    one that stays (always-on, keep_alive -1, no idle unload)."""
    secs = hub.control.expires_in(model)
    if secs is None:
        return "2318-01-01T00:00:00Z"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + max(0.0, secs)))


def _health(m: dict[str, Any]) -> str:
    if m["parked"]:
        return "parked"
    if m["unplaceable"]:
        return "unplaceable"
    if m["ready"]:
        return "ready"
    if m["loading"]:
        return "loading"
    return "available"


def openai_models(hub: Hub, client_allowed: Callable[[str], bool]) -> dict[str, Any]:
    created = int(time.time())
    data = []
    for m in hub.control.models_status():
        if not client_allowed(m["name"]):
            continue
        data.append({"id": m["name"], "object": "model", "created": created,
                     "owned_by": "appliance",
                     "status": _health(m), "ready_replicas": m["ready"],
                     "last_error": m["last_error"],
                     "reason": m["reason"]})
    return {"object": "list", "data": data}


def ollama_tags(hub: Hub, client_allowed: Callable[[str], bool]) -> dict[str, Any]:
    models = []
    for m in hub.control.models_status():
        if not client_allowed(m["name"]):
            continue
        meta = model_meta(hub, m["name"])
        models.append({"name": m["name"], "model": m["name"],
                       "modified_at": (meta.modified_at if meta is not None and meta.modified_at
                                       else time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                          time.gmtime(STARTED_AT))),
                       "size": _size_bytes(hub, m["name"]),
                       "digest": digest(hub, m["name"], meta),
                       "details": details(meta),
                       "status": _health(m), "last_error": m["last_error"], "reason": m["reason"]})
    return {"models": models}


def ollama_ps(hub: Hub, client_allowed: Callable[[str], bool]) -> dict[str, Any]:
    models = []
    for m in hub.control.models_status():
        if m["ready"] and client_allowed(m["name"]):
            size = _size_bytes(hub, m["name"])
            meta = model_meta(hub, m["name"])
            entry = {"name": m["name"], "model": m["name"], "size": size, "size_vram": size,
                     "digest": digest(hub, m["name"], meta), "details": details(meta),
                     "expires_at": _expires_at(hub, m["name"])}
            if meta is not None and meta.context_length:
                entry["context_length"] = meta.context_length
            models.append(entry)
    return {"models": models}
