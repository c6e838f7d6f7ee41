"""Fake fleets for admission tests: real NodeHandle objects in a real Registry, no sockets."""

from __future__ import annotations

from appliance.hub.fleet.nodes import NodeHandle, Registry
from appliance.wire import ModelState, NodeState

MODEL = "m"


def handle(name: str, *, slots: int | None = 1, max_concurrency: int | None = None, models=(MODEL,),
           model_state: str = "ready", paused: bool = False,
           over_limits: bool = False) -> NodeHandle:
    h = NodeHandle(name, f"http://{name}.test:9090", static=True)
    h.connected = True
    h.state = NodeState(name=name, slots=slots, max_concurrency=max_concurrency, paused=paused,
                        over_limits=over_limits, models=[ModelState(name=m, state=model_state)
                                                         for m in models])
    return h


def registry(*handles: NodeHandle) -> Registry:
    r = Registry()
    for h in handles:
        r.nodes[h.name] = h
    return r


def set_state(r: Registry, h: NodeHandle, **changes) -> None:
    """A new NodeState for `h` with `changes`, as the watch stream would deliver it."""
    st = h.state
    fields = {f: getattr(st, f) for f in st.__struct_fields__}
    fields.update(changes)
    r.apply_state(h, NodeState(**fields))
