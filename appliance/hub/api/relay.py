"""Copying one node's answer to the client: the hub's half of the stream relay.

Theory of operation: `LocalRelay.relay(node, ...)` sends one attempt of a request to one node and
copies its answer to the client byte for byte (`appliance.http.stream.relay_body`: one plain
loop, no parsing), or with the API translation `plan` asks for (`translate.Converted`: the
same loop, every read's payload through the converter). It waits for the node's first body
chunk before it answers the client, so a node that fails before the first byte -- refused
(503), broke off, was declared lost -- is raised as `NotAnswered(why)` and the router may
try another.
Two events may end the copy before the node does: the node declared lost (its handle's
`lost` event: a SIGSTOPped node would otherwise hold its streams for
Hub__UpstreamReadSeconds) and the end of the drain (`Hub.drain_over`). A `Cut` is tripped by
both -- called from their setters, `Flag`s (hub/fleet/nodes.py: Flag: no task per request) -- and
cancels only the read in progress, never a write to the client. Before the first byte a
lost node means "try another node" and a drain a 503 `shutting_down`; after it, the error
event in the stream's own framing (`stream_error`) and a proper end of the response.
The request's audit line and count are written (`Request.finish`) before its last byte.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, NoReturn

import trio

from appliance.bounds import CLEANUP_SECONDS
from appliance.client.upstream import Pool, UpstreamError
from appliance.http.errors import ApiError, Headers
from appliance.http.stream import Cut, receive_within, relay_body, stream_error
from appliance.hub import translate
from appliance.hub.decide import affinity
from appliance.hub.fleet.nodes import Flag
from appliance.hub.translate.common import Start
from appliance.hub.translate.errors import ERROR_BODY_LIMIT, engine_message
from appliance.hub.translate.usage import Meter, SSEMeter
from appliance.wire import WHOLE_HEADER

if TYPE_CHECKING:
    from appliance.hub.api.request import Request
    from appliance.hub.fleet.nodes import NodeHandle

log = logging.getLogger(__name__)

# Retry-After of a request cut by the drain before its first byte: another hub, or this
# one restarted, takes it a moment later.
SHUTTING_DOWN_RETRY_AFTER = 5.0
# Retry-After of a preempted background request: about one short essential answer.
PREEMPTED_RETRY_AFTER = 5.0


class NotAnswered(Exception):
    """The node failed before the first byte of its answer (refused, broke off, declared
    lost): nothing reached the client, so another node may be tried. The message says why,
    worded to follow "node NAME"."""


def preempted_error() -> ApiError:
    return ApiError(503, "preempted", "this background request gave its place to essential "
                    "work before its first byte (Priority__Preempt); retry shortly",
                    retry_after=PREEMPTED_RETRY_AFTER)


def _preempt(cut: Cut, req: Request) -> None:
    """Preempted: cut the request -- only before its first byte; a started stream is never
    cut, whoever asks."""
    if req.ttfb is None:
        cut.trip("preempted")


def cut_before_answer(cut: Cut) -> NoReturn:
    if cut.reason == "shutting_down":
        raise ApiError(503, "shutting_down", "the hub is shutting down; retry shortly",
                       retry_after=SHUTTING_DOWN_RETRY_AFTER)
    if cut.reason == "preempted":
        raise preempted_error()
    raise NotAnswered("was declared lost before answering")


class LocalRelay:
    """The router's way to relay in this process (router.Relaying): one attempt on one node
    over the hub's pool, reads bounded by Hub__UpstreamReadSeconds, cut by the drain."""

    preemptible = True

    def __init__(self, upstream: Pool, read_seconds: float, drain: Flag) -> None:
        self.upstream, self.read_seconds, self.drain = upstream, read_seconds, drain
        # What a node that gathers an answer for us is told: our read bound (node/whole.py).
        self.whole = (WHOLE_HEADER.encode(), b"%g" % read_seconds)

    def hangup(self) -> tuple[int, str]:
        return 499, "client_disconnected"

    async def relay(self, node: NodeHandle, req: Request, plan: translate.Plan) -> None:
        """Returns once the response went out; raises NotAnswered when the node failed
        before the first byte -- including it being declared lost while the request waited
        on it -- and ApiError when the request is refused (the drain ended, preempted). The
        node's `lost`, the drain and the request's `preempted` are Flags: the cut is called
        from their setters (hub/fleet/nodes.py: Flag), no watcher tasks."""
        cut = Cut()
        lost, drain, preempted = node.lost, self.drain, req.preempted
        on_lost, on_drain = partial(cut.trip, "node_lost"), partial(cut.trip, "shutting_down")
        on_preempt = partial(_preempt, cut, req)
        lost.subscribe(on_lost)
        drain.subscribe(on_drain)
        preempted.subscribe(on_preempt)
        resp = None
        # A per-node token wins; the routing key goes along for the other hubs (affinity.note).
        headers: Headers = [*req.forwarded, *req.id_headers, *node.auth_raw,
                            *affinity.note(req.route)]
        if plan.whole:  # only assembled here: the node sends the engine's stream in one body
            headers.append(self.whole)
        start = Start(int(req.t0 * 1e9), time.perf_counter_ns())  # Ollama's durations' clock
        try:
            with cut.reading():
                try:
                    resp = await self.upstream.request("POST", node.url + plan.path, headers,
                                                       plan.body, self.read_seconds)
                except UpstreamError as e:
                    raise NotAnswered(str(e)) from None
            if resp is None:
                cut_before_answer(cut)
            # The answer's four ends: a 503 (try another node), whole with its length, a
            # stream, a stream cut short (an error event in its own framing).
            # Passed through: the node's payload through a meter (its bytes as they are, bar
            # a usage chunk the client did not ask for); translated: through the converter.
            # Either parses every event for the usage. Both read by relay_body's one loop.
            conv = plan.converter(resp.status_code, resp.headers.get("content-type", ""), start)
            body = translate.Converted(resp, conv)
            if resp.status_code == 503:
                # The node (paused, full) or its engine (still loading) refused: try another.
                why = b""
                with cut.reading():
                    why = (await resp.read())[:ERROR_BODY_LIMIT]
                raise NotAnswered(f"answered 503 ({engine_message(503, why)})")
            whole = resp.whole()  # a short answer: no read to wait on
            first = body.take_whole(whole) if whole is not None else None
            if first is None:
                with cut.reading():
                    try:
                        first = await receive_within(body)
                    except UpstreamError as e:
                        raise NotAnswered(str(e)) from None
            if first is None or cut.reason == "preempted":
                # Preempted while the first read was already done: the client has had nothing.
                cut_before_answer(cut)
            req.answered(node.name, resp.status_code, time.perf_counter() - req.t0, conv.usage)
            if isinstance(conv, Meter):
                ctype = resp.headers.get("content-type", "application/json")
                # The node's length holds while the meter passes every byte on.
                clen = None if isinstance(conv, SSEMeter) and conv.drop else resp.headers.get(
                    "content-length")
            else:
                ctype = conv.content_type.decode()
                clen = None
            if body.ended:
                clen = str(len(first))
            start_headers = [(b"content-type", ctype.encode()), *req.id_headers]
            if clen is not None and clen.isdigit() and int(clen) == len(first):
                # A whole answer in the first read (every short, non-streamed one): one
                # body message with its length, no chunked framing, fewer writes.
                start_headers.append((b"content-length", clen.encode()))
                await req.send({"type": "http.response.start", "status": resp.status_code,
                                "headers": start_headers})
                await req.send_last(first)
                return
            await req.send({"type": "http.response.start", "status": resp.status_code,
                            "headers": start_headers})
            tail = b""
            if first:
                await req.send({"type": "http.response.body", "body": first, "more_body": True})
                tail = first[-2:]
            relayed = await relay_body(body, req.send, cut, (UpstreamError,), tail)
            if relayed.ended:
                await req.send_last(b"")
                return
            code = cut.reason or "node_lost"
            if code == "shutting_down":
                msg = ("the hub is shutting down: stream cut at the end of the drain "
                       "(Hub__DrainSeconds)")
            elif cut.reason:
                msg = f"node {node.name} was declared lost mid-stream ({node.lost_reason})"
            else:
                msg = f"node {node.name} {relayed.failure}"
            req.failed(code)
            log.warning("%s: request for %s from %s ends with %s", msg, req.model, req.client,
                        code)
            # A sized body cannot carry an error event; it just ends short.
            if clen is None:
                await req.send_last(stream_error(ctype, req.api, code, msg, relayed.tail))
            else:
                req.finish()
        finally:
            lost.unsubscribe(on_lost)
            drain.unsubscribe(on_drain)
            preempted.unsubscribe(on_preempt)
            if resp is not None and not resp.released:
                with trio.move_on_after(CLEANUP_SECONDS, shield=True):
                    await resp.aclose()
