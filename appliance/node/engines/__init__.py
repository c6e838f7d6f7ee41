"""Engines a node fronts. `make_engine(cfg, on_change)` picks one by `Engine__Kind`; the
engine calls `on_change` at every change of what it serves."""

from __future__ import annotations

from appliance.config import Config
from appliance.node.engines.base import Changed, Engine, unheard


def make_engine(cfg: Config, on_change: Changed = unheard) -> Engine:
    kind = cfg.engine.kind
    if kind == "sim":
        from appliance.node.engines.sim import SimEngine

        return SimEngine(cfg, on_change)
    if kind == "ollama":
        from appliance.node.engines.ollama import OllamaEngine

        return OllamaEngine(cfg, on_change)
    if kind == "openai":
        from appliance.node.engines.openai import OpenAIEngine

        return OpenAIEngine(cfg, on_change)
    if kind == "llamacpp":
        from appliance.node.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(cfg, on_change)
    raise ValueError(kind)
