"""The control plane: what runs where (placeholder: discovered models only, no loading).

Interface the router and status rely on (owner: the models-on-demand work, issue 4):
- `Control(cfg, registry, node_client, metrics_registry, audit)`
- `async run(*, task_status)`: the control loop in the hub's nursery.
- `known(model) -> bool`: in the catalog or discovered on a node.
- `unservable(model) -> RouteError | None`: parked (model_parked) / unplaceable.
- `await activate(model)`: ask first, wait for placement, poll for a ready replica;
  returns when one is ready, raises RouteError otherwise.
- `touch(model)`: a request used it (idle unload).
- `models_status() -> list[dict]`: the `models` list of /api/status (DESIGN 9).
"""

from __future__ import annotations

import trio

from appliance.config import Config
from appliance.hub.errors import RouteError


class Control:
    def __init__(self, cfg: Config, registry, node_client, metrics_registry, audit) -> None:
        self.cfg = cfg
        self.registry = registry

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    def known(self, model: str) -> bool:
        return model in self.registry.known_models()

    def unservable(self, model: str) -> RouteError | None:
        return None

    async def activate(self, model: str) -> None:
        raise RouteError(503, "no_capacity", f"no node can serve {model!r} now", retry_after=5)

    def touch(self, model: str) -> None:
        pass

    def models_status(self) -> list[dict]:
        out = []
        for name in sorted(self.registry.known_models()):
            ready = [h.name for h in self.registry.ready_nodes(name)]
            out.append({"name": name, "desired": 0, "ready": len(ready), "loading": 0, "parked": False,
                        "unplaceable": False, "reason": "", "last_error": "", "consecutive_start_failures": 0,
                        "nodes": ready})
        return out
