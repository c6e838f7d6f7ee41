"""What the hub says about itself: /api/status, the model lists, /api/ps.

Theory of operation: every payload here is derived on request from the registry, the
control plane and admission -- nothing is cached, so nothing goes stale. The keys of
/api/status are the contract of DESIGN 9; `priority` appears only while priority is on.
"""

from __future__ import annotations

import time

from appliance import __version__

MiB = 1024 * 1024


def node_entry(h) -> dict:
    st = h.state
    models = []
    if st is not None:
        models = [{"name": m.name, "state": m.state, "size_mb": m.size_mb,
                   "in_flight": h.in_flight.get(m.name, 0), "last_error": m.last_error} for m in st.models]
    return {
        "name": h.name,
        "url": h.url,
        "status": h.status(),
        "max_concurrency": st.max_concurrency if st is not None else None,
        "in_flight": h.in_flight_total,
        "models": models,
    }


def status_payload(hub) -> dict:
    out = {
        "version": __version__,
        "nodes": [node_entry(h) for h in hub.registry.nodes.values()],
        "models": hub.control.models_status(),
        "audit": {"path": hub.audit.path or "stdout", "write_errors": hub.audit.write_errors,
                  "last_error": hub.audit.last_error},
    }
    block = hub.admission.status_block()
    if block is not None:
        out["priority"] = block
    return out


def _size_bytes(hub, model: str) -> int:
    for h in hub.registry.nodes.values():
        if h.state is not None:
            m = h.state.model(model)
            if m is not None and m.size_mb:
                return m.size_mb * MiB
    return 0


def _health(m: dict) -> str:
    if m["parked"]:
        return "parked"
    if m["unplaceable"]:
        return "unplaceable"
    if m["ready"]:
        return "ready"
    if m["loading"]:
        return "loading"
    return "available"


def openai_models(hub, client_allowed) -> dict:
    created = int(time.time())
    data = []
    for m in hub.control.models_status():
        if not client_allowed(m["name"]):
            continue
        data.append({"id": m["name"], "object": "model", "created": created, "owned_by": "appliance",
                     "status": _health(m), "ready_replicas": m["ready"], "last_error": m["last_error"],
                     "reason": m["reason"]})
    return {"object": "list", "data": data}


def ollama_tags(hub, client_allowed) -> dict:
    models = []
    for m in hub.control.models_status():
        if not client_allowed(m["name"]):
            continue
        models.append({"name": m["name"], "model": m["name"], "modified_at": "1970-01-01T00:00:00Z",
                       "size": _size_bytes(hub, m["name"]), "digest": "",
                       "details": {"format": "", "family": "", "parameter_size": "", "quantization_level": ""},
                       "status": _health(m), "last_error": m["last_error"], "reason": m["reason"]})
    return {"models": models}


def ollama_ps(hub, client_allowed) -> dict:
    models = []
    for m in hub.control.models_status():
        if m["ready"] and client_allowed(m["name"]):
            size = _size_bytes(hub, m["name"])
            models.append({"name": m["name"], "model": m["name"], "size": size, "size_vram": size,
                           "digest": "", "details": {}, "expires_at": "0001-01-01T00:00:00Z"})
    return {"models": models}
