"""The floor under the hub's CPU per request: an ASGI app that reads the body and answers
two bytes -- served by our listener (appliance/server/serve.py: the connection every
listener runs, plain or TLS), or with `hypercorn` as the first argument by hypercorn's
own trio server, for comparison; with `lean CERT KEY`, our listener over TLS.
bench/overhead.py runs them beside the real hub so the hub's own share (routing, proxying,
audit, metrics) and TLS's can be read off in one run."""

import sys
from functools import partial

import trio

from appliance.http.asgi import read_body
from appliance.server.serve import serve


async def app(scope, receive, send):
    if scope["type"] == "lifespan":  # hypercorn's (our listener sends none): answered
        while (await receive())["type"] != "lifespan.shutdown":  # startup, then shutdown
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await read_body(receive, 1 << 20)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"{}"})


async def main(server: str, certfile: str = "", keyfile: str = "") -> None:
    async with trio.open_nursery() as nursery:
        if server == "hypercorn":
            from hypercorn.config import Config
            from hypercorn.trio import serve as hyper_serve

            cfg = Config()
            cfg.bind = ["127.0.0.1:0"]
            cfg.accesslog = None
            cfg.loglevel = "WARNING"  # (its "Running on" line: ours follows)
            binds = await nursery.start(partial(hyper_serve, app, cfg,
                                                mode="asgi"))
            print(f"floor ({server}) listening on {binds[0]}", file=sys.stderr, flush=True)
        else:  # its own line: `appliance floor listening on http://HOST:PORT`
            await nursery.start(partial(serve, app, "127.0.0.1:0", "floor", certfile=certfile,
                                        keyfile=keyfile))


if __name__ == "__main__":
    trio.run(main, *(sys.argv[1:] or ["lean"]))
