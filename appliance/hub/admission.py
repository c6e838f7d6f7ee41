"""Admission: may this request go now, or must it wait? (placeholder: everything goes)

Interface the router relies on (owner: the priority-classes work, issue 3):
- `Admission(cfg, registry, metrics_registry)`
- `await admit(model, cls, client) -> Ticket`: returns when the request may be sent;
  raises RouteError (queue_full, queue_timeout, priority_wait_timeout). The router picks a
  node and counts it in flight without a checkpoint after this returns.
- `release(ticket)`: the request ended (any way).
- `await wait_slot(node, model, cls)`: Queue__SlotWaitSeconds before sending.
- `status_block() -> dict | None`: `priority` for /api/status (None while off).
"""

from __future__ import annotations

from appliance.config import Config


class Ticket:
    __slots__ = ("model", "cls", "client")

    def __init__(self, model: str, cls: str, client: str) -> None:
        self.model, self.cls, self.client = model, cls, client


class Admission:
    def __init__(self, cfg: Config, registry, metrics_registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.enabled = cfg.priority.enabled

    def effective_class(self, client_cls: str, headers) -> str:
        return client_cls if self.enabled else "normal"

    async def admit(self, model: str, cls: str, client: str) -> Ticket:
        return Ticket(model, cls, client)

    def release(self, ticket: Ticket) -> None:
        pass

    async def wait_slot(self, node, model: str, cls: str) -> None:
        pass

    def status_block(self) -> dict | None:
        return None
