"""llama-server's own word on its slots: how many (`/props` total_slots) and how many are
busy (`/slots`), for the `llamacpp` engine (issue 27).

Theory of operation: a peer's numbers, so bounded: `total_slots` is believed between 1 and
`MAX_ENGINE_SLOTS` (beyond: the bound, logged once per model); `/slots` is read every
`SLOTS_POLL_SECONDS` while the server runs and the busy count (never above the slots) is
published on the watch stream when it changes, so the hub sees load that reaches the
engine another way. A server that does not serve `/slots` (llama_cpp.server, llama-server
`--no-slots`) is not asked again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import httpx
import trio

log = logging.getLogger(__name__)

# How often a ready server's /slots is read: a heartbeat's time at most, so the hub sees
# outside load that late.
SLOTS_POLL_SECONDS = 1.0
# The most slots believed of one server: llama-server allocates a KV cache per slot, and
# no GPU today holds a useful context for more than a few hundred (its -np is an int).
MAX_ENGINE_SLOTS = 256


class Slotted(Protocol):
    slots: int | None
    busy: int | None


_said_absurd: set[str] = set()


def engine_slots(value: object, model: str) -> int | None:
    """llama-server's `total_slots`, believed between 1 and MAX_ENGINE_SLOTS (beyond: the
    bound, logged once per model); anything not an int: not said."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    if 1 <= value <= MAX_ENGINE_SLOTS:
        return value
    if model not in _said_absurd:
        _said_absurd.add(model)
        log.warning("llamacpp: %s says it has %d slots: taken as %d", model, value,
                    min(MAX_ENGINE_SLOTS, max(1, value)))
    return min(MAX_ENGINE_SLOTS, max(1, value))


def busy_slots(slots: object) -> int | None:
    """How many of llama-server's /slots are processing (`is_processing`, or an older
    server's `state` != 0); None when the answer is not that list."""
    if not isinstance(slots, list) or len(slots) > 4 * MAX_ENGINE_SLOTS:
        return None
    n = 0
    for s in slots:
        if not isinstance(s, dict):
            return None
        busy = s.get("is_processing")
        if busy is None:
            busy = s.get("state", 0) != 0
        n += bool(busy)
    return n


async def watch_slots(client: httpx.AsyncClient, url: str, m: Slotted,
                      on_change: Callable[[], None]) -> None:
    """Read `url` (a server's /slots) until cancelled; `m.busy` follows it."""
    while True:
        try:
            r = await client.get(url)
            if r.status_code in (404, 501):
                return
            busy = busy_slots(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            busy = None
        if busy is not None and m.slots is not None:
            busy = min(busy, m.slots)
        if busy != m.busy:
            m.busy = busy
            on_change()
        await trio.sleep(SLOTS_POLL_SECONDS)
