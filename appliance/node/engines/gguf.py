"""What a GGUF file says about its model, read from its header: architecture, context
length, parameter count (size label, else counted from the tensor infos), quantization,
capabilities, and a digest -- for /api/show, /api/tags and /api/ps of llama.cpp models.

Theory of operation: a GGUF file starts with `GGUF`, a version, the tensor and key-value
counts, then typed key-values, then one info per tensor: name, dimensions, type, offset
(the format's spec: ggml/docs/gguf.md). We read the key-values, keeping the few we want and
skipping the rest (arrays of fixed-size items and unwanted strings by seeking), then the
tensor infos to count parameters. Capabilities come from what the file says: an encoder
with pooling embeds, a chat template that mentions tools calls them, one that knows
`<think>` thinks (vision needs a projector file: the engine adds it from its arguments).
The digest is sha256 over the first DIGEST_BYTES of the file and its size -- not Ollama's
hash of the whole file (gigabytes), but stable for the file and changed by any new one.
Any malformation ends the reading with what was found so far: this is metadata, never a
reason to refuse a model.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any, BinaryIO

from appliance.wire import ModelMeta

MAGIC = b"GGUF"
# More key-values than any real model has (llama.cpp models carry a few dozen).
MAX_KV = 4096
# Longest key or string value we read; the tokenizer's chat template is the longest (KiBs).
MAX_STRING = 1 << 20
# More tensors than any real model has (a 400B model has a few thousand).
MAX_TENSORS = 1 << 16
# Dimensions of one tensor: ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
# How much of the file the digest covers (with its size): the header and the first weights.
DIGEST_BYTES = 4 * 1024 * 1024
# Encoder-only architectures: they embed and cannot complete.
ENCODERS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder",
                      "modern-bert", "neo-bert"})
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


def _string(f: BinaryIO, keep: bool = True) -> bytes:
    (n,) = struct.unpack("<Q", _read(f, 8))
    if not keep:
        f.seek(n, 1)
        return b""
    if n > MAX_STRING:
        raise _Bad("string too long")
    return _read(f, n)


def _value(f: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _FIXED:
        raw = _read(f, _FIXED[kind])
        return struct.unpack(_FMT[kind], raw)[0] if keep else None
    if kind == 8:
        s = _string(f, keep)
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


def _wanted(key: str) -> bool:
    return (key.startswith("general.") or key.endswith((".context_length", ".pooling_type"))
            or key == "tokenizer.chat_template")


def _count_params(f: BinaryIO, tensors: int) -> int:
    """Elements over every tensor info (the parameter count)."""
    total = 0
    for _ in range(min(tensors, MAX_TENSORS)):
        _string(f, False)
        (dims,) = struct.unpack("<I", _read(f, 4))
        if dims > MAX_DIMS:
            raise _Bad("too many dimensions")
        n = 1
        for d in struct.unpack(f"<{dims}Q", _read(f, 8 * dims)):
            n *= d
        _read(f, 12)  # type (u32) and offset (u64)
        total += n
    return total


def human_count(n: int) -> str:
    """Ollama's way of saying a parameter count: 494.03M, 1.2B, 8.0B."""
    if n >= 1_000_000_000:
        return f"{n / 1e9:.1f}B"
    if n >= 1_000_000:
        return f"{n / 1e6:.2f}M"
    if n >= 1_000:
        return f"{n / 1e3:.2f}K"
    return str(n)


def capabilities(arch: str, pooling: object, template: str) -> list[str]:
    """What the file says the model can do (Ollama's words)."""
    encoder = arch in ENCODERS
    caps = [] if encoder else ["completion"]
    if encoder or (isinstance(pooling, int) and pooling > 0):
        caps.append("embedding")
    if not encoder and "tools" in template:
        caps.append("tools")
    if not encoder and ("<think>" in template or "enable_thinking" in template):
        caps.append("thinking")
    return caps


def digest_of(path: str) -> str:
    """sha256 over the first DIGEST_BYTES of the file and its size ("" when unreadable)."""
    try:
        with open(path, "rb") as f:
            h = hashlib.sha256(f.read(DIGEST_BYTES))
            h.update(struct.pack("<Q", os.fstat(f.fileno()).st_size))
    except OSError:
        return ""
    return h.hexdigest()


def read_meta(path: str) -> ModelMeta | None:
    """The model's metadata, or None when the file is not a readable GGUF. Reads the
    key-values and the tensor infos (seconds of I/O at worst: call it off the event loop)."""
    found: dict[str, object] = {}
    params = 0
    try:
        with open(path, "rb") as f:
            if f.read(4) != MAGIC:
                return None
            _version, tensors, kv = struct.unpack("<IQQ", _read(f, 20))
            for _ in range(min(kv, MAX_KV)):
                key = _string(f).decode("utf-8", "replace")
                (kind,) = struct.unpack("<I", _read(f, 4))
                want = _wanted(key)
                v = _value(f, kind, want)
                if want:
                    found[key] = v
            if kv <= MAX_KV:
                params = _count_params(f, tensors)
    except (OSError, _Bad, struct.error):
        if not found:
            return None
    arch = str(found.get("general.architecture") or "")
    ctx = found.get(f"{arch}.context_length")
    ftype = found.get("general.file_type")
    template = found.get("tokenizer.chat_template")
    size = str(found.get("general.size_label") or "") or (human_count(params) if params else "")
    return ModelMeta(digest=digest_of(path), format="gguf", family=arch,
                     families=[arch] if arch else None, parameter_size=size,
                     quantization_level=FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
                     context_length=ctx if isinstance(ctx, int) else 0,
                     capabilities=capabilities(arch, found.get(f"{arch}.pooling_type"),
                                               template if isinstance(template, str) else ""))
