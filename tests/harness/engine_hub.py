"""An in-process hub in front of one fake engine (an ASGI app), for hub/api tests that need
the hub's whole request path but no processes: node `n` is static and says model `m` is
ready on a llama.cpp engine with 4 slots; the hub audits to `tmp/audit.log`."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio

from appliance.config import load
from appliance.http.asgi import App
from appliance.hub.run import run_hub
from appliance.server.serve import serve
from appliance.wire import EngineInstall, ModelState, NodeState


async def hub_before(nursery: trio.Nursery, tmp: Path, engine: App) -> str:
    """Start the hub and the engine in `nursery`; the hub's URL."""
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Audit__Path": str(tmp / "audit.log")})
    hub, (host, port) = await nursery.start(run_hub, cfg, trio.Event())
    nhost, nport = await nursery.start(partial(serve, engine, "127.0.0.1:0", "fake"))
    h, _ = hub.registry.upsert("n", f"http://{nhost}:{nport}", static=True)
    hub.registry.apply_state(h, NodeState(name="n", slots=4, engines=[EngineInstall("llamacpp")],
                                          models=[ModelState(name="m", state="ready")]))
    return f"http://{host}:{port}"
