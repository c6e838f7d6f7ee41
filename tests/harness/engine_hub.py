"""An in-process hub in front of one fake node or engine (an ASGI app), for tests that need
the hub's whole request path but no processes: the app is served on port 0, the hub knows
it as a static node whose state the test gives (by default model `m` ready on a llama.cpp
engine with 4 slots), and audits to `tmp/audit.log` (or nowhere)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import trio

from appliance.config import load
from appliance.http.asgi import App
from appliance.hub.hub import Hub
from appliance.hub.run import run_hub
from appliance.server.serve import serve
from appliance.wire import EngineInstall, ModelState, NodeState

M_READY = [ModelState(name="m", state="ready")]


async def hub_before(nursery: trio.Nursery, tmp: Path | None, engine: App,
                     env: dict[str, str] | None = None, state: NodeState | None = None
                     ) -> tuple[Hub, str]:
    """Start the hub (with `env`) and the app in `nursery`: the hub and its URL."""
    cfg = load({"Hub__Listen": "127.0.0.1:0", "Metrics__Listen": "",
                "Audit__Path": str(tmp / "audit.log") if tmp else "/dev/null", **(env or {})})
    hub, (host, port) = await nursery.start(run_hub, cfg, trio.Event())
    nhost, nport = await nursery.start(partial(serve, engine, "127.0.0.1:0", "fake"))
    state = state or NodeState(name="n", slots=4, engines=[EngineInstall("llamacpp")],
                               models=M_READY)
    h, _ = hub.registry.upsert(state.name, f"http://{nhost}:{nport}", static=True)
    hub.registry.apply_state(h, state)
    return hub, f"http://{host}:{port}"
