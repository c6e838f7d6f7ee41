"""One correction to hypercorn's trio server, applied once on import by appliance.http.asgi.
Since issue 15 hypercorn serves only TLS connections (plain ones: appliance/server/connection.py,
which closes at the peer's end by construction); the fix still holds for those.

Theory of operation: hypercorn 0.18's `TCPServer.run` reads a connection until the peer
closes it, then leaves its task group -- which waits for every task in it, including
the keep-alive timer (`_idle_timeout`, `keep_alive_timeout`: 75 s here). Only then does
it close the socket. So every connection a client closes while idle stays open on our
side, in CLOSE-WAIT, for up to 75 s: under load hundreds of fds (issue 11 saw 606 on a
node). Stopping the timer once the read loop has seen the end lets the task group, and
then the socket, close at once. Nothing else of hypercorn's behaviour changes; if a
future hypercorn renames what this touches, the patch is skipped (with the old delay)
rather than breaking the server.
"""

from __future__ import annotations

from hypercorn.trio import tcp_server

_PATCHED = "_appliance_closes_promptly"


def apply() -> None:
    cls = tcp_server.TCPServer
    if getattr(cls, _PATCHED, False) or not hasattr(cls, "_read_data"):
        return
    original = cls._read_data

    async def _read_data(self: tcp_server.TCPServer) -> None:
        await original(self)
        idle = getattr(self, "idle_task", None)
        if idle is not None:
            await idle.stop()  # the peer is gone: no keep-alive to time out

    cls._read_data = _read_data  # type: ignore[method-assign]
    setattr(cls, _PATCHED, True)
