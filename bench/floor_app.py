"""The floor under the hub's CPU per request: an ASGI app that reads the body and answers
two bytes, behind our listener (appliance/server/listener.py) -- served by the lean HTTP/1.1
server (appliance/server/connection.py, what plain-TCP listeners use), or with `hypercorn` as the
first argument by hypercorn's trio worker (what TLS listeners use). bench/overhead.py runs
both beside the real hub so the hub's own share (routing, proxying, audit, metrics) can
be read off in one run."""

import sys
from functools import partial

import trio
from hypercorn.config import Config as HyperConfig

from appliance.http.asgi import http_only, read_body
from appliance.server.listener import Limits, serve_guarded


async def app(scope, receive, send):
    await read_body(receive, 1 << 20)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def main(server: str) -> None:
    cfg = HyperConfig()  # as appliance.http.asgi.serve sets it
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    cfg.keep_alive_timeout = 75
    cfg.max_app_queue_size = 4
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve_guarded, http_only(app), cfg, Limits(),
                                            shutdown_trigger=trio.sleep_forever,
                                            lean=server != "hypercorn"))
        print(f"floor ({server}) listening on {binds[0]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "lean")
