"""The Prometheus scrape as an ASGI app, for the metrics listener of hub and node.

Theory of operation: `prometheus-client` renders; we only serve. The metrics listener is
its own listener (appliance/server/serve.py) in the role's nursery (a scrape never waits
behind client traffic), open without a key: bind it where Prometheus reaches it. `before_scrape`
callbacks run first, so values read from disk or derived from live state (certificate
expiry, seconds since a heartbeat) are fresh at each scrape rather than polled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from appliance.http.asgi import App, Receive, Scope, Send, send_text


def render(registry: CollectorRegistry, before_scrape: Sequence[Callable[[], None]] = ()) -> bytes:
    for fn in before_scrape:
        fn()
    return generate_latest(registry)


def metrics_app(registry: CollectorRegistry,
                before_scrape: list[Callable[[], None]] | None = None) -> App:
    hooks = before_scrape if before_scrape is not None else []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] != "/metrics":
            await send_text(send, 404, "not found; the scrape is at /metrics\n")
            return
        await send_text(send, 200, render(registry, hooks), CONTENT_TYPE_LATEST.encode())

    return app
