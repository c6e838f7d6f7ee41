"""Which nodes' engines can serve a model: `Models__N__Engine`, else the source's form.

Theory of operation (DESIGN 9.2): a model is tied to an engine kind by the
catalog (`Models__N__Engine`), or by its source's form -- a `.gguf` path is a file only
llama.cpp reads -- and otherwise any engine may serve it. A node says its kind in its
`NodeState.engine` (the hub checks the word: `NodeHandle.kind()`); a node whose kind is
unknown serves only models that any engine may serve. Placement, parking counts,
`/api/pull` and `/api/show` ask this one rule; idle unloads and room-making ask
`unloads`. What a model can do is what the engines of capable nodes say
(`ModelMeta.capabilities`); a request that needs what they say the model lacks (what it
needs: translate/prompt.py's `needs`) is refused (400, as Ollama answers) before any node
sees it. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

LLAMACPP = "llamacpp"
# An OpenAI-compatible upstream serves the models it was started with (node/engines/
# openai.py): its node cannot unload one, so none is idle-unloaded or made a victim there.
FIXED_KINDS = frozenset({"openai"})


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


def unloads(h: Any) -> bool:
    """Can node `h` (a NodeHandle) unload a model? Not a fixed upstream's."""
    return h.kind() not in FIXED_KINDS


def why_none(spec: Any, up: list[Any]) -> str:
    """The reason when no node that is up runs the engine the model needs."""
    need = engine_for(getattr(spec, "engine", ""), getattr(spec, "source", ""))
    kinds = ", ".join(f"{h.name} {h.kind() or 'unknown'}" for h in up) or "none up"
    how = "Models__N__Engine" if getattr(spec, "engine", "") else "its .gguf source"
    return f"needs a {need} engine ({how}); no node that is up runs one ({kinds})"


# --- what a model can do -----------------------------------------------------------------

def model_capabilities(spec: Any, nodes: Iterable[Any], model: str) -> set[str] | None:
    """What the engines of capable nodes say `model` can do (their union); None when none
    of them says (an engine that reports no capabilities: nothing is refused for it)."""
    out: set[str] | None = None
    for h in nodes:
        st = h.state
        m = st.model(model) if st is not None else None
        if m is None or m.meta is None or m.meta.capabilities is None or not serves(spec, h):
            continue
        out = (out or set()) | set(m.meta.capabilities)
    return out


def lacking(caps: set[str], needed: list[tuple[str, str]]) -> str | None:
    """What a body that `needed` these (translate/prompt.py's `needs`) asks that a model
    of `caps` cannot do (its name), None when nothing."""
    for cap, what in needed:
        if cap not in caps:
            return what
    return None
