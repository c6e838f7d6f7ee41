"""The supervisor loop that keeps a node's handle true (the trio shell of nodes.py).

Theory of operation: one task per node in the hub's nursery, a small explicit loop:
follow the node's watch stream, take every `NodeState` it sends as the truth, mark the
node lost when the stream ends or stays silent for 3 x heartbeat (MISSED_HEARTBEATS),
back off (capped, jittered), reconnect -- until the node is forgotten (`ctl forget`
cancels its handle's scope) or, announced, unreachable for long enough. It never catches
`Cancelled`. The stream goes through the request path's `Pool` (appliance/client/upstream.py):
one set of connections, one token and one TLS setup per node.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable

import msgspec
import trio

from appliance.client.upstream import Pool, Response, UpstreamError
from appliance.http.lines import LineTooLong, aiter_lines
from appliance.hub.fleet.nodes import MISSED_HEARTBEATS, NodeHandle, Registry
from appliance.wire import (
    HEARTBEAT_HEADER,
    MAX_WATCH_LINE,
    Heartbeat,
    StateEvent,
    heartbeat_of,
    watch_decoder,
)

log = logging.getLogger(__name__)

# First reconnect delay; doubles per failure up to Hub__ReconnectMaxSeconds.
BACKOFF_START = 0.5


async def follow_once(pool: Pool, h: NodeHandle, registry: Registry, heartbeat: float,
                      on_event: Callable[[str, NodeHandle, str], None]) -> None:
    """Follow one watch stream until it ends; raise on transport errors and silences
    (MISSED_HEARTBEATS of the node's own interval, as its stream says: h.heartbeat)."""
    headers = [(k.encode(), v.encode()) for k, v in h.auth.items()]
    resp = await pool.request("GET", f"{h.url}/node/v1/watch", headers, b"",
                              MISSED_HEARTBEATS * heartbeat)
    try:
        if resp.status_code != 200:
            with trio.move_on_after(MISSED_HEARTBEATS * heartbeat):
                body = await resp.receive()
            raise WatchRefused(f"watch answered {resp.status_code}: "
                               f"{body[:200].decode(errors='replace')}")
        h.heartbeat = heartbeat_of(resp.headers.get(HEARTBEAT_HEADER), heartbeat)
        silence = MISSED_HEARTBEATS * h.heartbeat
        # Split on b"\n" only: U+2028 and its kin are inside a line (appliance/http/lines.py).
        lines = aiter_lines(_body(resp), MAX_WATCH_LINE).__aiter__()
        while True:
            with trio.fail_after(silence):
                try:
                    line = await lines.__anext__()
                except StopAsyncIteration:
                    return
            h.last_line = trio.current_time()
            if not line.strip():
                continue
            ev = watch_decoder.decode(line)
            if isinstance(ev, StateEvent):
                first = not h.connected
                registry.apply_state(h, ev.state)
                if first:
                    on_event("node_up", h, "")
            elif isinstance(ev, Heartbeat):
                pass
    finally:
        await resp.aclose()


class WatchRefused(Exception):
    """The node answered the watch with a status other than 200."""


async def _body(resp: Response) -> AsyncIterator[bytes]:
    """The response's payload as it arrives (no deadline: the caller keeps one per line)."""
    while chunk := await resp.receive():
        yield chunk


async def supervise(pool: Pool, h: NodeHandle, registry: Registry, *,
                    heartbeat: float,
                    backoff_max: float, on_event: Callable[[str, NodeHandle, str], None],
                    forget_after: float | None = None) -> None:
    """Connect, follow, mark lost, back off (capped, jittered), reconnect -- until removed
    (an operator's `ctl forget` cancels `h.cancel_scope`) or, for an announced node,
    unreachable for `forget_after` seconds: then it is forgotten (`node_forgotten`)."""
    with h.cancel_scope:
        await _supervise(pool, h, registry, heartbeat, backoff_max, on_event, forget_after)


async def _supervise(pool: Pool, h: NodeHandle, registry: Registry,
                     heartbeat: float, backoff_max: float,
                     on_event: Callable[[str, NodeHandle, str], None],
                     forget_after: float | None) -> None:
    backoff = BACKOFF_START
    while not h.removed:
        try:
            await follow_once(pool, h, registry, heartbeat, on_event)
            reason = "watch stream ended"
        except trio.TooSlowError:
            reason = f"no heartbeat for {MISSED_HEARTBEATS * (h.heartbeat or heartbeat):g} s"
        except (UpstreamError, WatchRefused) as e:
            reason = str(e)
        except (msgspec.DecodeError, msgspec.ValidationError, LineTooLong) as e:
            reason = f"bad watch line: {e}"
        if h.connected:
            on_event("node_lost", h, reason)
            backoff = BACKOFF_START
        if h.connected or h.lost_since is None:
            h.lost_since = trio.current_time()
        registry.mark_lost(h, reason)
        if (forget_after is not None and not h.static and h.lost_since is not None
                and trio.current_time() - h.lost_since >= forget_after):
            log.warning("node %s at %s forgotten: unreachable for %g s (%s)", h.name, h.url,
                        trio.current_time() - h.lost_since, reason)
            registry.forget(h)
            on_event("node_forgotten", h, reason)
            return
        delay = backoff * random.uniform(0.5, 1.0)
        backoff = min(backoff * 2, backoff_max)
        with trio.move_on_after(delay):
            await h.dial_now.wait()
        if h.dial_now.is_set():
            h.dial_now = trio.Event()
            backoff = BACKOFF_START  # it said it is back: a failed dial retries soon
