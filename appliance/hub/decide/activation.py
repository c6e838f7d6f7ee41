"""The activation waiter: a request for a model that is not ready anywhere.

Owns the wait of such a request (DESIGN 3 step 4): ask for a placement, wait briefly for
that very decision and then for a ready replica, bounded by Router__ActivationWaitSeconds,
and say what is happening (503 `model_loading`, parked, unplaceable); on a follower hub
the same through etcd (`activate_via_leader`). It owns no state (`Source` is the control
plane). The steps: `activate`'s docstring.
"""

from __future__ import annotations

from typing import Protocol

import trio

from appliance.http.errors import ApiError
from appliance.hub.cluster.etcd import EtcdError

# The seed's poll period: a load takes tens of seconds, so 250 ms is noise against it.
POLL_SECONDS = 0.25
# Retry-After of a timed-out wait: a client should come back soon, not hold a socket.
RETRY_AFTER_SECONDS = 5


class Source(Protocol):
    def ask(self, model: str) -> int:
        """Clear the previous result, start a fresh attempt; its generation."""

    async def wait_decided(self, model: str, generation: int) -> None:
        """Returns once the attempt of `generation` (or a later one) has decided."""

    def has_ready(self, model: str) -> bool: ...

    def why_unservable(self, model: str) -> ApiError | None:
        """Parked or unplaceable now (no fresh attempt)."""


async def activate(source: Source, model: str, wait_seconds: float,
                   generation: int | None = None) -> None:
    """Returns once a replica of `model` is ready; raises ApiError otherwise. `generation`:
    the decision already asked for (else one is asked for here).

    1. Ask first, always. Asking clears the previous placement result and makes a fresh
       attempt, so a model that fitted nowhere an hour ago is placed now that room was made.
    2. Wait for *that* attempt's placement decision (its generation), not the whole window.
       Found nowhere, or parked: answer at once with why, no Retry-After.
    3. Poll every 250 ms for a ready replica -- polled rather than notified on purpose: a load
       takes tens of seconds at best, so a poll's latency is noise against it -- until
       `Router__ActivationWaitSeconds` run out, stopping early when the model becomes
       unservable (the fifth failed start parks it mid-wait).
    4. Timed out: 503 `model_loading` "loading; retry shortly" with Retry-After.

    The waiter owns no state; `source` is the control plane (see `Source`).

    On a follower hub (several hubs, appliance/hub/cluster/) the same steps go through etcd:
    `activate_via_leader` asks by writing the ask (its revision is the generation), waits --
    polled, bounded by the same window -- until the leader's shared record says it decided
    that ask, and reads parked/unplaceable from the mirrored record. etcd unreachable: 503
    `no_leader` with Retry-After at once; models already ready never come here, so they keep
    serving. A failover in progress (etcd answers, no leader yet) is waited out.
    """
    if generation is None:
        generation = source.ask(model)
    with trio.move_on_after(wait_seconds):
        await source.wait_decided(model, generation)
        while True:
            if source.has_ready(model):
                return
            err = source.why_unservable(model)
            if err is not None:
                raise err
            await trio.sleep(POLL_SECONDS)
    raise ApiError(503, "model_loading", f"model {model!r} is loading; retry shortly",
                     retry_after=RETRY_AFTER_SECONDS)


class Leader(Protocol):
    """The cluster member as a follower's waiter sees it."""

    lease_seconds: float
    up: bool  # etcd answers

    def has_leader(self) -> bool: ...

    async def ask_leader(self, model: str) -> int:
        """Write the ask; its revision. Raises EtcdError."""

    def decided(self, model: str) -> int:
        """The last ask revision the leader decided for `model` (shared record)."""


def no_leader(leader: Leader, why: str) -> ApiError:
    return ApiError(503, "no_leader",
                    f"no hub leads the fleet now ({why}); models already ready keep "
                      f"serving, placing a model must wait for a leader",
                    retry_after=leader.lease_seconds)


async def activate_via_leader(leader: Leader, source: Source, model: str,
                              wait_seconds: float) -> None:
    """A follower's activation: ask the leader through etcd, wait for its decision and a
    ready replica (seen on this hub's own watch streams); ApiError otherwise.

    etcd unreachable: `no_leader` at once (no hub can decide). etcd answering but no leader
    (a failover: the dead leader's lease ran out, the next hub campaigns within a tick):
    the ask is written all the same and waited for -- the new leader answers every ask
    newer than the last one decided, so a request caught in the gap is served by it."""
    if not leader.up:
        raise no_leader(leader, "etcd unreachable")
    try:
        generation = await leader.ask_leader(model)
    except EtcdError as e:
        raise no_leader(leader, f"etcd: {e}") from None
    with trio.move_on_after(wait_seconds):
        while True:
            if source.has_ready(model):
                return
            if leader.decided(model) >= generation:
                err = source.why_unservable(model)
                if err is not None:
                    raise err
            elif not leader.up:
                raise no_leader(leader, "etcd became unreachable while the model was asked for")
            await trio.sleep(POLL_SECONDS)
    if not leader.has_leader():
        raise no_leader(leader, f"none elected within {wait_seconds:g} s")
    raise ApiError(503, "model_loading", f"model {model!r} is loading; retry shortly",
                     retry_after=RETRY_AFTER_SECONDS)
