"""What a refusal by a key's limits says; limits.py decides when there is one.

Owns the 429 `rate_limit_exceeded`: its Retry-After (or `x-should-retry: false` where no
wait helps), and the headers clients read to pace themselves -- OpenAI's
x-ratelimit-{limit,remaining,reset}-{requests,tokens} and the Anthropic SDK's
anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}. Plain functions over a
key's windows; it decides nothing and keeps no state.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

from appliance.http.errors import ApiError, Headers


class Counted(Protocol):
    """A key's sliding window (limits.Window)."""

    def used(self, now: float) -> int: ...
    def empty_in(self, now: float) -> float: ...


# (kind: "requests" or "tokens", the limit (None: none), its window)
Limit = tuple[str, int | None, Counted]


def refusal(limits: Sequence[Limit], now: float, wait: float | None, kind: str,
            message: str) -> ApiError:
    """The 429: Retry-After `wait` seconds, rounded up (None: a retry never helps)."""
    extra = headers(limits, now)
    if wait is None:
        extra.append((b"x-should-retry", b"false"))
    else:
        extra.append((b"retry-after", str(max(1, math.ceil(wait))).encode()))
    return ApiError(429, "rate_limit_exceeded", message, extra=extra, kind=kind)


def headers(limits: Sequence[Limit], now: float) -> Headers:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} and the Anthropic SDK's
    anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}."""
    out: Headers = []
    for kind, limit, window in limits:
        if limit is None:
            continue
        remaining = max(0, limit - window.used(now))
        reset = window.empty_in(now)
        for name, value in ((f"x-ratelimit-limit-{kind}", str(limit)),
                            (f"x-ratelimit-remaining-{kind}", str(remaining)),
                            (f"x-ratelimit-reset-{kind}", duration(reset)),
                            (f"anthropic-ratelimit-{kind}-limit", str(limit)),
                            (f"anthropic-ratelimit-{kind}-remaining", str(remaining)),
                            (f"anthropic-ratelimit-{kind}-reset", _date(now + reset))):
            out.append((name.encode(), value.encode()))
    return out


def duration(s: float) -> str:
    """OpenAI's x-ratelimit-reset-* form: "1s", "6m0s", "1h2m3s"."""
    whole = math.ceil(s)
    h, rest = divmod(whole, 3600)
    m, sec = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


def _date(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
