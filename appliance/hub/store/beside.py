"""Batch lines stepping aside on the hub's CPU while other work is about.

Theory of operation: background lines never take the places the reserve keeps (admission
sees to that), but each costs the hub about as much CPU as a chat, and on a hub box of
few cores a batch's 80+ lines a second slow the essential and normal requests beside it.
`Beside` watches admission's arrivals of requests that are not background (priority on;
off: every arrival less the lines this hub started) and the ones waiting: while one came
within QUIET_SECONDS, the runner keeps at most Batch__BesidePercent of
Batch__MaxConcurrent lines in flight (at least one); with none about, all of them. A line
waits in `room` before it goes, looking again as lines end or every CHECK_SECONDS.
`background: true` responses are lines too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

# Other work counts as about this long after it last arrived (a chatting client's next
# turn comes within seconds; a batch alone runs at full width within one).
QUIET_SECONDS = 1.0
CHECK_SECONDS = 0.1


@dataclass
class Arrivals:
    """Admission's counts as `Beside` reads them: requests arrived that are not background
    (priority off: all of them), whether that count includes background ones, and
    requests of those classes waiting now."""
    others: int
    with_background: bool
    waiting: int


class Beside:
    def __init__(self, counts: Callable[[], Arrivals] | None) -> None:
        """`counts`: admission's, read at each look; None: never steps aside."""
        self.counts = counts
        self.running = 0  # lines in flight (batch lines and background responses)
        self.started_total = 0
        self.seen = -1  # the most arrivals of other work seen
        self.last = -QUIET_SECONDS  # when other work was last about
        self._ended = trio.Event()

    def started(self) -> None:
        self.running += 1
        self.started_total += 1

    def ended(self) -> None:
        self.running -= 1
        self._ended.set()
        self._ended = trio.Event()

    def about(self) -> bool:
        """Whether other work arrived within QUIET_SECONDS or waits now."""
        if self.counts is None:
            return False
        now = trio.current_time()
        a = self.counts()
        others = a.others - (self.started_total if a.with_background else 0)
        if self.seen >= 0 and others > self.seen or a.waiting > 0:
            self.last = now
        self.seen = max(self.seen, others)
        return now - self.last < QUIET_SECONDS

    def allowed(self, most: int, percent: int = 25) -> int:
        """Lines that may be in flight: `percent` of `most` (Batch__BesidePercent of
        Batch__MaxConcurrent, at least one) while other work is about, else `most`."""
        return max(1, most * percent // 100) if self.about() else most

    async def room(self, most: int, percent: int = 25) -> None:
        """Return when one more line may go."""
        while self.running >= self.allowed(most, percent):
            with trio.move_on_after(CHECK_SECONDS):
                await self._ended.wait()


def of_admission(admission: Any) -> Callable[[], Arrivals]:
    """`counts` read from the hub's admission (hub/decide/admission.py)."""
    from appliance.hub.decide.priority import ESSENTIAL, NORMAL

    def counts() -> Arrivals:
        classes = admission.core.classes
        if admission.enabled:
            es, no = classes[ESSENTIAL], classes[NORMAL]
            return Arrivals(es.requests + no.requests, False, es.waiting + no.waiting)
        return Arrivals(sum(s.requests for s in classes.values()), True, 0)

    return counts
