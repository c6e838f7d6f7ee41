"""Speaking HTTP/1.1 by hand to a server under test, for the tests that check its framing
and deadlines byte by byte (test_h1, test_listener_reload, test_fastio): read one answer
with h11 (which rejects broken framing), or everything until the server closes; and, for
the fake upstreams that clients are tested against (test_upstream, test_relay_body), read
one request.
"""

from __future__ import annotations

import h11
import trio


async def until_closed(stream, limit: float = 100) -> bytes:
    got = b""
    with trio.fail_after(limit):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return got
            if not data:
                return got
            got += data


async def response(stream, conn: h11.Connection) -> tuple[int, dict, bytes]:
    status, headers, body = 0, {}, b""
    with trio.fail_after(30):
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif isinstance(ev, h11.Response):
                status = ev.status_code
                headers = {k.decode(): v.decode() for k, v in ev.headers}
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                return status, headers, body
            elif isinstance(ev, h11.InformationalResponse):
                continue
            else:
                raise AssertionError(ev)


async def request(stream, conn: h11.Connection) -> h11.Request | None:
    """Read one whole request on `stream` (a server's side): its head; None: the client
    closed first."""
    head = None
    while True:
        ev = conn.next_event()
        if ev is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            if not data:
                return None
            conn.receive_data(data)
        elif isinstance(ev, h11.Request):
            head = ev
        elif isinstance(ev, h11.EndOfMessage):
            return head
