"""Which nodes' engines can serve a model: `Models__N__Engine`, else the source's form.

Theory of operation (DESIGN 9.2, issue 20): a model is tied to an engine kind by the
catalog (`Models__N__Engine`), or by its source's form -- a `.gguf` path is a file only
llama.cpp reads -- and otherwise any engine may serve it. A node says its kind in its
`NodeState.engine` (the hub checks the word: `NodeHandle.kind()`); a node whose kind is
unknown serves only models that any engine may serve. Placement, parking counts,
`/api/pull` and `/api/show` ask this one rule. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

LLAMACPP = "llamacpp"


def engine_for(engine: str, source: str) -> str:
    """The engine kind a model needs ("": any): the catalog's, else a `.gguf` path's."""
    if engine:
        return engine
    if source.strip().lower().endswith(".gguf"):
        return LLAMACPP
    return ""


def serves(spec: Any, h: Any) -> bool:
    """Can node `h` (a NodeHandle) run the model of `spec` (placement.Spec)?"""
    need = engine_for(getattr(spec, "engine", ""), getattr(spec, "source", ""))
    return not need or h.kind() == need


def why_none(spec: Any, up: list[Any]) -> str:
    """The reason when no node that is up runs the engine the model needs."""
    need = engine_for(getattr(spec, "engine", ""), getattr(spec, "source", ""))
    kinds = ", ".join(f"{h.name} {h.kind() or 'unknown'}" for h in up) or "none up"
    how = "Models__N__Engine" if getattr(spec, "engine", "") else "its .gguf source"
    return f"needs a {need} engine ({how}); no node that is up runs one ({kinds})"
