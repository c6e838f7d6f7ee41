"""The GGUF header reader (appliance/node/engines/gguf.py) on files the gguf package writes."""

import make_gguf

from appliance.node.engines.gguf import read_meta


def test_reads_architecture_and_context_length(tmp_path):
    tiny, kev = make_gguf.write_pair(tmp_path, seed=1)
    meta = read_meta(str(tiny))
    assert meta.format == "gguf" and meta.family == "llama" and meta.context_length == make_gguf.N_CTX
    assert read_meta(str(kev)).family == "kev"


def test_anything_else_is_no_metadata(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"not a gguf at all")
    assert read_meta(str(tmp_path / "x.bin")) is None
    assert read_meta(str(tmp_path / "missing.gguf")) is None
    tiny, _ = make_gguf.write_pair(tmp_path, seed=1)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:40])  # the header, then nothing: what was read, or None
    meta = read_meta(str(cut))
    assert meta is None or meta.format == "gguf"
