"""The floor under the hub's CPU per request: hypercorn (trio worker) serving an ASGI app
that reads the body and answers two bytes. bench/overhead.py runs it beside the real hub
so the hub's own share (routing, proxying, audit, metrics) can be read off in one run."""

import trio

from appliance.asgi import read_body, serve


async def app(scope, receive, send):
    await read_body(receive, 1 << 20)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


if __name__ == "__main__":
    trio.run(serve, app, "127.0.0.1:0", "floor")
