"""Ending a relayed stream early, cleanly: the node was lost, or the drain ran out.

Theory of operation: the router copies a node's answer to the client chunk by chunk
(`appliance.http.stream.relay_chunks`). Two events may end that copy before the node
does -- the node declared lost (its handle's `lost` event: a SIGSTOPped node would
otherwise hold its streams for Hub__UpstreamReadSeconds) and the end of the drain
(`Hub.drain_over`). A `Cut` watches both and cancels only the read in progress. What the
client then gets is decided here: before the first byte, a lost node means "try another
node" and a drain a 503 `shutting_down`; after it, the error event in the stream's own
framing (`appliance.http.stream.stream_error`) and a proper end of the response.
"""

from __future__ import annotations

from appliance.http.errors import ApiError
from appliance.http.stream import Cut

# Retry-After of a request cut by the drain before its first byte: another hub, or this
# one restarted, takes it a moment later.
SHUTTING_DOWN_RETRY_AFTER = 5.0


def cut_before_answer(cut: Cut) -> tuple[bool, str]:
    if cut.reason == "shutting_down":
        raise ApiError(503, "shutting_down", "the hub is shutting down; retry shortly",
                       retry_after=SHUTTING_DOWN_RETRY_AFTER)
    return False, "was declared lost before answering"
