"""The node's adapter for the built-in simulated engine (`Engine__Kind=sim`).

Theory of operation: the sim speaks Ollama's API, so this adapter is the Ollama adapter
pointed at a sim server it runs itself: `run()` starts `serve_sim` in its own nursery on
127.0.0.1:0 (the sim prints its `appliance sim listening on` line), then polls it exactly
as it would poll Ollama. The server dies with `run()`. Models, load times and failures
come from `Sim__*`; `installs()` says `sim`, so nobody mistakes it for a real engine.
"""

from __future__ import annotations

import trio

from appliance.config import Config
from appliance.node.engines.base import Changed, unheard
from appliance.node.engines.ollama import OllamaEngine
from appliance.node.engines.params import OPENAI
from appliance.sim.server import make_sim_app, reconfigure, serve_sim

SIM_LISTEN = "127.0.0.1:0"  # loopback only: the node is the sim's one client


class SimEngine(OllamaEngine):
    kind = "sim"

    def __init__(self, cfg: Config, on_change: Changed = unheard) -> None:
        super().__init__(cfg, on_change)
        self.url = ""  # known once the sim listens
        self.app = make_sim_app(cfg.sim)  # the sim's state is self.app.state

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(serve_sim, self.app, SIM_LISTEN)
            self.url = f"http://{host}:{port}"
            await super().run(task_status=task_status)

    def dialect(self, model: str) -> str:
        """The sim takes OpenAI's fields as OpenAI names them (unlike Ollama)."""
        return OPENAI

    def reconfigure(self, cfg: Config) -> None:
        """New Sim__* settings (SIGHUP); the next poll shows the new model list."""
        reconfigure(self.app, cfg.sim)
