"""What a GGUF file says about its model, read from its header: architecture, context
length, size label, quantization -- for /api/show and /api/tags of llama.cpp models.

Theory of operation: a GGUF file starts with `GGUF`, a version, the tensor and key-value
counts, then typed key-values (the format's spec: ggml/docs/gguf.md). We read key by key
until we have what we want or the key-values end, skipping values we do not need (arrays
of fixed-size items by seeking; string arrays -- the tokenizer's -- item by item). Any
malformation ends the reading with what was found so far: this is metadata, never a
reason to refuse a model.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from appliance.wire import ModelMeta

MAGIC = b"GGUF"
# More key-values than any real model has (llama.cpp models carry a few dozen).
MAX_KV = 4096
# Longest key or string value we read; the tokenizer's chat template is the longest (KiBs).
MAX_STRING = 1 << 20
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
        12: "<d"}
# llama.cpp's file types (general.file_type), as Ollama names the quantization.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K",
              32: "BF16"}


class _Bad(Exception):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _Bad("short read")
    return b


def _string(f: BinaryIO) -> bytes:
    (n,) = struct.unpack("<Q", _read(f, 8))
    if n > MAX_STRING:
        raise _Bad("string too long")
    return _read(f, n)


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _FIXED:
        raw = _read(f, _FIXED[kind])
        return struct.unpack(_FMT[kind], raw)[0] if keep else None
    if kind == 8:
        s = _string(f)
        return s.decode("utf-8", "replace") if keep else None
    if kind == 9:
        (item, count) = struct.unpack("<IQ", _read(f, 12))
        if item in _FIXED:
            f.seek(_FIXED[item] * count, 1)
        else:
            for _ in range(count):
                _value(f, item, False)
        return None
    raise _Bad(f"unknown value type {kind}")


def read_meta(path: str) -> ModelMeta | None:
    """The model's metadata, or None when the file is not a readable GGUF."""
    found: dict[str, object] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                return None
            _version, _tensors, kv = struct.unpack("<IQQ", _read(f, 20))
            for _ in range(min(kv, MAX_KV)):
                key = _string(f).decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", _read(f, 4))
                want = key.startswith("general.") or key.endswith(".context_length")
                v = _value(f, kind, want)
                if want:
                    found[key] = v
                arch = found.get("general.architecture")
                if arch and f"{arch}.context_length" in found and "general.file_type" in found:
                    break
    except (OSError, _Bad, struct.error):
        if not found:
            return None
    arch = str(found.get("general.architecture") or "")
    ctx = found.get(f"{arch}.context_length")
    ftype = found.get("general.file_type")
    return ModelMeta(format="gguf", family=arch, families=[arch] if arch else None,
                     parameter_size=str(found.get("general.size_label") or ""),
                     quantization_level=FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
                     context_length=ctx if isinstance(ctx, int) else 0)
