"""What a decoded body costs, counted against the listener's body budget.

Theory of operation: the server holds a request's body bytes against `Hub__MaxBufferedBytes`
while the request lives (appliance/server/connection.py). Decoding the JSON builds Python
objects that cost far more than the bytes they came from: a 33 MB body of a million tiny
messages decodes to ~300 MB, and a translated route keeps a second copy. So before the
router decodes a body it holds an estimate of the decoded size too -- the bytes plus
ITEM_BYTES for every JSON item (each `{`, `[`, `,` and `:` opens one), counted in C by
`bytes.count` -- through the server's `BodyBudget` (the ASGI extension BODY_BUDGET). Over
the bound: 503 `busy` with Retry-After, as for the raw bytes; nothing is decoded -- unless
the estimate alone is over the whole budget (a retry never fits): 413 `body_too_large`.
"""

from __future__ import annotations

from typing import Any, Protocol

from appliance.http.errors import ApiError

# The ASGI extension (scope["extensions"]) under which a server offers its BodyBudget.
BODY_BUDGET = "appliance.body_budget"
# Decoded cost of one JSON item, with room for a translation's copy: measured with
# tracemalloc, msgspec builds 59 bytes per item for a million {"role","content"} messages,
# 44 per number of a long array, ~70 for objects of unique keys.
ITEM_BYTES = 96
BUSY_RETRY_AFTER = 1.0


class BodyBudget(Protocol):
    @property
    def bound(self) -> int:
        """The listener's whole budget: a request over it alone never fits."""
        ...

    def hold(self, n: int) -> bool:
        """Hold `n` more bytes of the listener's body budget until this request ends;
        False (nothing held) when that would pass the bound."""
        ...

    def release(self, n: int) -> None:
        """`n` bytes of this request's body no longer held (a stream written to disk)."""
        ...


def release(scope: dict[str, Any] | None, n: int) -> None:
    """Give back `n` body bytes the app has written away (no budget offered: nothing)."""
    budget: BodyBudget | None = ((scope or {}).get("extensions") or {}).get(BODY_BUDGET)
    if budget is not None:
        budget.release(n)


def decoded_estimate(body: bytes) -> int:
    """The bytes a decoded `body` may cost: its own plus ITEM_BYTES per JSON item."""
    items = body.count(b"{") + body.count(b"[") + body.count(b",") + body.count(b":")
    return len(body) + ITEM_BYTES * items


def hold_decoded(scope: dict[str, Any] | None, body: bytes, held: int | None = None) -> None:
    """Hold the decoded estimate of `body` (less the `held` bytes the server already holds:
    the body's own, or fewer when it came compressed, http/encoding.py) against the
    server's budget; 503 `busy` when over, 413 `body_too_large` when the estimate alone is
    over the whole budget. No budget offered (a test's scope): nothing."""
    budget: BodyBudget | None = ((scope or {}).get("extensions") or {}).get(BODY_BUDGET)
    if budget is None:
        return
    estimate = decoded_estimate(body)
    extra = estimate - (len(body) if held is None else held)
    if extra > 0 and not budget.hold(extra):
        if estimate > budget.bound:
            raise ApiError(413, "body_too_large",
                           f"the request body decodes to an estimated {estimate} bytes, over "
                           f"the server's whole body budget of {budget.bound} "
                           "(MaxBufferedBytes): a retry would not fit either")
        raise ApiError(503, "busy", "the server holds too many decoded request bodies now; "
                       "retry shortly", retry_after=BUSY_RETRY_AFTER)
