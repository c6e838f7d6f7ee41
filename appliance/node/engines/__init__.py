"""Engines a node fronts. `make_engine(cfg)` picks one by `Engine__Kind`."""

from __future__ import annotations

from appliance.config import Config
from appliance.node.engines.base import Engine


def make_engine(cfg: Config) -> Engine:
    kind = cfg.engine.kind
    if kind == "sim":
        from appliance.node.engines.sim import SimEngine

        return SimEngine(cfg)
    if kind == "ollama":
        from appliance.node.engines.ollama import OllamaEngine

        return OllamaEngine(cfg)
    if kind == "openai":
        from appliance.node.engines.openai import OpenAIEngine

        return OpenAIEngine(cfg)
    if kind == "llamacpp":
        from appliance.node.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(cfg)
    raise ValueError(kind)
