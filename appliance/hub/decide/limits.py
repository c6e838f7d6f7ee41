"""Per-key limits: requests and tokens a minute, tokens a day, requests at once.

Owns each key's sliding windows, the reservation at admission and its settlement from the
real usage, the 429 with its Retry-After and x-ratelimit-* headers, and fair queueing's
demand for the same tenant. Plain synchronous code: no trio, no clock of its own -- every
call takes `now` -- so tests drive it with any numbers. It must not wait nor answer (the
router does). The rules: `Limiter`'s docstring.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from appliance.config import ClientConfig
from appliance.http.errors import ApiError
from appliance.hub.decide import fair, ratelimit

MINUTE = 60.0
DAY = 86400.0
# Bin widths: a minute in 600 bins keeps the window's slack at 0.1 s; a day in 1,440.
MINUTE_BIN = 0.1
DAY_BIN = 60.0
# The usual rule of thumb for English text with BPE tokenizers (OpenAI's help pages: "one
# token is about 4 characters"); the JSON around the text makes it an over-estimate.
BYTES_PER_TOKEN = 4
# Output caps beyond this are absurd (no model has a 16M-token context): a 400.
MAX_OUTPUT_CAP = 1 << 24
# The output cap fields of the APIs, in the order they win (OpenAI, Responses, Ollama).
NUM_PREDICT = "options.num_predict"
CAP_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens", NUM_PREDICT)
# Retry-After of a refusal by MaxConcurrent: when a running request ends is not known; a
# short answer takes about this long.
CONCURRENT_RETRY_AFTER = 1.0
# Retry-After of a token refusal that running requests' settlements may cure: a second.
SETTLE_RETRY_AFTER = 1.0
# The weight of the newest settlement in a key's averages (use to reservation, tokens per
# byte, output): about the last ten requests.
RATIO_WEIGHT = 0.2


class Window:
    """Amounts added over time; `used(now)` is the sum over the last span (and one bin)."""

    __slots__ = ("span", "width", "nbins", "bins", "total")

    def __init__(self, span: float, width: float) -> None:
        self.span, self.width = span, width
        self.nbins = round(span / width)
        self.bins: OrderedDict[int, int] = OrderedDict()
        self.total = 0

    def _prune(self, now: float) -> int:
        """Drop the bins older than the window; returns the bin of `now`."""
        now_bin = math.floor(now / self.width + 1e-9)  # 90.1 / 0.1 is 900.999...
        oldest = now_bin - self.nbins
        while self.bins:
            b, n = next(iter(self.bins.items()))
            if b >= oldest:
                break
            self.bins.popitem(last=False)
            self.total -= n
        return now_bin

    def used(self, now: float) -> int:
        self._prune(now)
        return self.total

    def add(self, now: float, n: int) -> int:
        """Add `n` now; returns the bin, for `adjust`."""
        b = self._prune(now)
        if self.bins and next(reversed(self.bins)) > b:
            b = next(reversed(self.bins))  # a clock that stepped back: the newest bin
        self.bins[b] = self.bins.get(b, 0) + n
        self.total += n
        return b

    def adjust(self, b: int, delta: int) -> None:
        """Change what bin `b` holds (a settlement); nothing once the bin has expired."""
        if b in self.bins:
            self.bins[b] += delta
            self.total += delta

    def wait(self, now: float, need: int, limit: int) -> float:
        """Seconds until `need` more fits under `limit`, as old bins expire (0: now)."""
        over = self.used(now) + need - limit
        if over <= 0:
            return 0.0
        for b, n in self.bins.items():
            over -= n
            if over <= 0:
                return max(0.0, (b + self.nbins + 1) * self.width - now)
        return math.inf  # `need` alone is over the limit

    def empty_in(self, now: float) -> float:
        """Seconds until everything in the window has expired (0: empty now)."""
        self._prune(now)
        if not self.bins:
            return 0.0
        return max(0.0, (next(reversed(self.bins)) + self.nbins + 1) * self.width - now)


class TenantLimits(NamedTuple):
    """One key's limits as this hub enforces them (its share); None: no limit."""

    rpm: int | None
    tpm: int | None
    tpd: int | None
    concurrent: int | None
    weight: float


def share(limit: int | None, hubs: int) -> int | None:
    if limit is None or hubs <= 1 or limit == 0:
        return limit
    return max(1, limit // hubs)


def limits_of(c: ClientConfig, hubs: int = 1) -> TenantLimits:
    return TenantLimits(share(c.rpm, hubs), share(c.tpm, hubs), share(c.tokens_per_day, hubs),
                  share(c.max_concurrent, hubs), c.weight)


NO_LIMITS = TenantLimits(None, None, None, None, 1.0)


def output_cap(obj: dict[str, Any]) -> int | None:
    """The request's own output cap, or None; ApiError 400 for a negative or absurd one."""
    opts = obj.get("options")
    for name in CAP_FIELDS:
        if name == NUM_PREDICT:
            v = opts.get("num_predict") if isinstance(opts, dict) else None
        else:
            v = obj.get(name)
        if v is None or isinstance(v, bool) or not isinstance(v, int):
            continue  # a wrong type is the API checks' business (translate)
        if name == NUM_PREDICT and v < 0:
            continue  # Ollama: -1 means "until the model stops"
        if v < 0 or v > MAX_OUTPUT_CAP:
            raise ApiError(400, "invalid_request",
                           f"{name}={v} is out of range (0..{MAX_OUTPUT_CAP})", param=name)
        return v
    return None


def input_estimate(body_bytes: int) -> int:
    return max(1, -(-body_bytes // BYTES_PER_TOKEN))


class Settled(NamedTuple):
    input: int
    output: int
    estimated: bool  # no usage from the engine: the reservation stands


class Tenant:
    """One key's windows and counters (kept across reloads by name)."""

    __slots__ = ("requests", "tokens", "day", "in_flight", "pending", "ratio", "in_per_byte",
                 "out_avg", "served_in", "served_out",
                 "admitted", "limited")

    def __init__(self) -> None:
        self.requests = Window(MINUTE, MINUTE_BIN)
        self.tokens = Window(MINUTE, MINUTE_BIN)
        self.day = Window(DAY, DAY_BIN)
        self.in_flight = 0
        self.pending = 0  # tokens reserved by requests still running (not yet settled)
        # Recent use / reservation of the key's settled requests (an EWMA from the first
        # one; None until then), input tokens per body byte and output tokens (fair
        # queueing's expected cost).
        self.ratio: float | None = None
        self.in_per_byte = 1.0 / BYTES_PER_TOKEN
        self.out_avg: float | None = None
        self.served_in = 0
        self.served_out = 0
        self.admitted = 0
        self.limited = 0


@dataclass(slots=True)
class Lease:
    """One admitted request's reservation; `settle` once when it ends. It is also the
    request's fair-queueing demand (fair.Demand), found with the same tenant: `cost`
    charged at grant, the key's `weight`, `used` filled in by `settle`."""

    tenant: Tenant
    reserved: int
    input_bound: int
    cap: int | None
    minute_bin: int
    day_bin: int
    cost: int = 0
    weight: float = 1.0
    used: int | None = None
    done: bool = False

    def settle(self, used: tuple[int, int] | None,
               counted: tuple[int, int] | None = None) -> Settled:
        """The request ended having used `used` = (input, output) tokens as the engine
        says (None: it said nothing; then `counted` is what the hub counted itself, if
        anything). Returns what was counted."""
        if self.done:
            return Settled(0, 0, True)
        self.done = True
        t = self.tenant
        t.in_flight -= 1
        t.pending -= self.reserved
        if used is None and counted is not None:
            # The window keeps the whole reservation; what is reported (metrics, audit) is
            # the hub's count (generated chunks, the prompt's text / 4), marked estimated.
            out = max(0, counted[1]) if self.cap is None else min(max(0, counted[1]), self.cap)
            u = Settled(min(max(0, counted[0]), self.input_bound), out, True)
            # ... and what was counted beyond it (a stream hung up after more than it
            # reserved): a key never dodges its window by hanging up.
            over = u.input + u.output - self.reserved
            if over > 0:
                t.tokens.adjust(self.minute_bin, over)
                t.day.adjust(self.day_bin, over)
        elif used is None:
            # The window keeps the whole reservation; what is reported (metrics, audit) is
            # the input's estimate, marked estimated: an output nobody counted is not made up.
            u = Settled(input_estimate(self.input_bound), 0, True)
        else:
            inp = min(max(0, used[0]), self.input_bound)
            out = max(0, used[1])
            if self.cap is not None:
                out = min(out, self.cap)
            u = Settled(inp, out, False)
            delta = u.input + u.output - self.reserved
            if self.reserved:
                r = (u.input + u.output) / self.reserved
                t.ratio = r if t.ratio is None else t.ratio + RATIO_WEIGHT * (r - t.ratio)
            if self.input_bound:
                t.in_per_byte += RATIO_WEIGHT * (u.input / self.input_bound - t.in_per_byte)
            t.out_avg = u.output if t.out_avg is None else (
                t.out_avg + RATIO_WEIGHT * (u.output - t.out_avg))
            t.tokens.adjust(self.minute_bin, delta)
            t.day.adjust(self.day_bin, delta)
            self.used = u.input + fair.OUTPUT_COST * u.output
        t.served_in += u.input
        t.served_out += u.output
        return u


class Limiter:
    """Every key's state; `admit` -> Lease or ApiError 429.

    The one decision: may this key's request go now, and if not, exactly when could it?
    - Each limit is a sliding window (`Window`): amounts added at admission into fixed bins
      (0.1 s for a minute, 60 s for a day), a bin dropped once it is older than the span. The
      check covers one bin more than the span, so ANY span-long interval of real time lies
      inside what some admission checked: the limit holds over every minute, not over
      calendar minutes (LiteLLM #24677: fixed windows let 2x through at a boundary). The
      extra bin costs 0.17 % of a minute's throughput.
    - Tokens are reserved at admission -- the input's bound (the body's bytes: a token is at
      least one byte of text, and the JSON around the text covers a chat template's markers)
      plus the request's output cap (max_tokens and its spellings, or
      Auth__ReserveOutputTokens) -- and settled from the real usage when the request ends
      (`Lease.settle`). Usage is clamped to what is possible (an engine that lies is not
      believed): input at most the bound, output at most the cap the request named. So a
      reservation only shrinks, and the tokens of any minute stay within the limit. A request
      naming no cap (or Ollama's negative num_predict) is sent with one where the key has a
      token limit (`uncapped`: Auth__ReserveOutputTokens, lowered to what the key has left),
      so none runs past its reservation. No usage at all (an engine that reports none): the
      reservation stands. (Fair queueing charges a request its expected cost instead,
      `Limiter.admit`: the key's recent tokens per byte and output; `input_estimate`, bytes
      / 4, is no bound.)
    - A refusal is a 429 `rate_limit_exceeded` whose Retry-After is the time at which the
      window would have room for this request as its old reservations expire (rounded up to
      the second) -- sooner when the key's running requests, settling below what they reserved
      (by the key's recent ratio of use to reservation), would make the room before that: 1 s
      (when they end is not known) or when the rest expires -- with the
      x-ratelimit-* headers OpenAI sends and the anthropic-ratelimit-* ones the Anthropic SDK
      reads. A limit of 0 refuses every request (no Retry-After, x-should-retry: false); so
      does a request that alone reserves more than the limit.
    - With several hubs each enforces limit / hubs alive (`hubs`, from the cluster view),
      rounded down, at least 1 where the limit is not 0.
    """

    def __init__(self, clients: list[ClientConfig], reserve_output: int,
                 hubs: Callable[[], int] = lambda: 1) -> None:
        self.tenants: dict[str, Tenant] = {}
        self.hubs = hubs
        self.configure(clients, reserve_output)

    def configure(self, clients: list[ClientConfig], reserve_output: int) -> None:
        """New limits (SIGHUP); each key's use so far is kept."""
        self.clients = {c.name: c for c in clients}
        self.reserve_output = reserve_output

    def find(self, name: str) -> tuple[TenantLimits, Tenant]:
        """Key `name`'s limits (this hub's share of them) and its windows, found once."""
        c = self.clients.get(name)
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant()
        return NO_LIMITS if c is None else limits_of(c, max(1, self.hubs())), t

    def uncapped(self, name: str, now: float, body_bytes: int) -> int | None:
        """The output cap a request naming none (or a negative one) is sent with while key
        `name` has a token limit -- Auth__ReserveOutputTokens, lowered to what the key has
        left after the body -- so no request runs past its reservation; None: no token limit
        (the engine's own cap applies)."""
        lim, t = self.find(name)
        left = [limit - window.used(now) - body_bytes
                for limit, window in ((lim.tpm, t.tokens), (lim.tpd, t.day)) if limit is not None]
        return max(1, min(self.reserve_output, *left)) if left else None

    def admit(self, name: str, now: float, body_bytes: int, cap: int | None) -> Lease:
        """Reserve for one request of key `name`, or raise ApiError 429. The lease carries
        the request's fair-queueing demand (fair.Demand), found with the same tenant."""
        lim, t = self.find(name)
        reserve = body_bytes + (cap if cap is not None else self.reserve_output)
        refusal = None if lim is NO_LIMITS else self._check(name, lim, t, now, reserve)
        if refusal is not None:
            t.limited += 1
            raise refusal
        t.requests.add(now, 1)
        mb = t.tokens.add(now, reserve)
        db = t.day.add(now, reserve)
        t.in_flight += 1
        t.pending += reserve
        t.admitted += 1
        # Fair queueing's charge at grant: the request's expected cost -- the input at the
        # key's recent tokens per body byte, the output at the key's recent average (at most
        # the cap) -- so that what the settlement corrects at the end is small either way. A
        # cap charged whole and refunded at the end would lower a busy key's counter below
        # a newcomer's after the newcomer was lifted to it.
        out = cap if cap is not None else self.reserve_output
        if t.out_avg is not None:
            out = min(out, math.ceil(t.out_avg))
        cost = max(1, math.ceil(body_bytes * t.in_per_byte)) + fair.OUTPUT_COST * out
        return Lease(t, reserve, body_bytes, cap, mb, db, cost, lim.weight)

    def _check(self, name: str, lim: TenantLimits, t: Tenant, now: float,
               reserve: int) -> ApiError | None:
        checks = (("requests per minute", "Rpm", lim.rpm, t.requests, 1, "requests"),
                  ("tokens per minute", "Tpm", lim.tpm, t.tokens, reserve, "tokens"),
                  ("tokens per day", "TokensPerDay", lim.tpd, t.day, reserve, "tokens"))
        worst: tuple[float, str, str, int, str] | None = None
        for what, var, limit, window, need, kind in checks:
            if limit is None:
                continue
            wait = window.wait(now, need, limit)
            # Nothing settled yet: any of it may come back.
            credit = int(t.pending * (1.0 - (t.ratio if t.ratio is not None else 0.0)))
            if kind == "tokens" and SETTLE_RETRY_AFTER < wait < math.inf and credit > 0:
                # The key's running requests will settle below what they reserved (by its
                # recent ratio of use to reservation): the room comes back sooner than old
                # reservations expire -- at their end (not known: a second) or when the
                # rest expires.
                sooner = window.wait(now, max(0, need - credit), limit)
                wait = max(SETTLE_RETRY_AFTER, sooner) if sooner < wait else wait
            if wait > 0 and (worst is None or wait > worst[0]):
                worst = (wait, what, var, limit, kind)
        if worst is None and lim.concurrent is not None and t.in_flight >= lim.concurrent:
            if lim.concurrent == 0:
                worst = (math.inf, "requests at once", "MaxConcurrent", 0, "requests")
            else:
                return self._refuse(lim, t, now, CONCURRENT_RETRY_AFTER, "requests",
                                    f"{t.in_flight} requests of client {name!r} are running "
                                    f"(Auth__Clients__N__MaxConcurrent={lim.concurrent})")
        if worst is None:
            return None
        wait, what, var, limit, kind = worst
        if limit == 0:
            return self._refuse(lim, t, now, None, kind,
                                f"client {name!r} may send no requests: its {what} limit "
                                f"(Auth__Clients__N__{var}) is 0")
        if math.isinf(wait):
            return self._refuse(lim, t, now, None, kind,
                                f"this request reserves {reserve} tokens (its body's bytes + "
                                f"output cap), more than client {name!r}'s {what} limit of "
                                f"{limit} (Auth__Clients__N__{var}); lower max_tokens")
        return self._refuse(lim, t, now, wait, kind,
                            f"client {name!r} is over its {what} limit of {limit} "
                            f"(Auth__Clients__N__{var}); retry in {math.ceil(wait)} s")

    def _refuse(self, lim: TenantLimits, t: Tenant, now: float, wait: float | None, kind: str,
                message: str) -> ApiError:
        tokens = (lim.tpm, t.tokens) if lim.tpm is not None else (lim.tpd, t.day)
        return ratelimit.refusal((("requests", lim.rpm, t.requests), ("tokens", *tokens)), now,
                                 wait, kind, message)

    def status(self, now: float, queued: dict[str, int] | None = None) -> dict[str, Any]:
        """Per key: limits, use this minute and the last 24 h, running, queued (`queued`:
        the admission queue's count per key), tokens served and the share of them."""
        out: dict[str, Any] = {}
        queued = queued or {}
        names = list(self.clients) + [n for n in self.tenants if n not in self.clients]
        total = sum(t.served_in + t.served_out for t in self.tenants.values()) or 1
        for name in names:
            lim, t = self.find(name)
            out[name] = {
                "limits": {"rpm": lim.rpm, "tpm": lim.tpm, "tokens_per_day": lim.tpd,
                           "max_concurrent": lim.concurrent, "weight": lim.weight},
                "minute": {"requests": t.requests.used(now), "tokens": t.tokens.used(now)},
                "day_tokens": t.day.used(now),
                "in_flight": t.in_flight, "queued": queued.get(name, 0),
                "served": {"input": t.served_in, "output": t.served_out},
                "share": round((t.served_in + t.served_out) / total, 4),
                "requests": t.admitted, "limited": t.limited,
            }
        return out
