"""Cancel what a request waits on when its client hangs up.

Theory of operation: an ASGI server says `http.disconnect` on `receive` once the client
is gone (after the body has been read). `cancel_on_disconnect` runs a watcher beside the
work; when the client goes, the work's scope is cancelled and `Gone.gone` is set, so the
caller can tell "finished" from "abandoned". `keep_going`, when given, is asked first: a
server says "disconnect" as its last byte goes out too, and a finished response must not
be interrupted then.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio

Receive = Callable[[], Awaitable[dict[str, Any]]]


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone away."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class Gone:
    __slots__ = ("gone",)

    def __init__(self) -> None:
        self.gone = False


@asynccontextmanager
async def cancel_on_disconnect(receive: Receive,
                               finished: Callable[[], bool] | None = None) -> AsyncIterator[Gone]:
    """`async with cancel_on_disconnect(receive) as g:` -- the body is cancelled when the
    client hangs up (then `g.gone`), unless `finished()` says the answer is complete."""
    g = Gone()
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            await wait_disconnect(receive)
            if finished is not None and finished():
                return
            g.gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            yield g
        finally:
            nursery.cancel_scope.cancel()
