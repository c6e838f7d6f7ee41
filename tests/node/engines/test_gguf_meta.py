"""The GGUF header reader (appliance/node/engines/gguf.py) on files the gguf package writes."""

from appliance.node.engines.gguf import read_meta
from tests.harness import make_gguf


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


def test_digest_parameter_count_and_capabilities(tmp_path):
    """llama.cpp models in /api/tags need a digest and a parameter size (issue 20)."""
    from appliance.node.engines import gguf
    from appliance.node.engines.llamacpp import with_args

    tiny, kev = make_gguf.write_pair(tmp_path, seed=1)
    meta = read_meta(str(tiny))
    assert len(meta.digest) == 64 and meta.digest == read_meta(str(tiny)).digest
    assert meta.digest != read_meta(str(kev)).digest
    assert meta.parameter_size == "124.61K"  # counted from the tensor infos (no size label)
    assert meta.capabilities == ["completion"]  # its template names no tools, no <think>
    assert gguf.human_count(494_032_768) == "494.03M" and gguf.human_count(8_030_000_000) == "8.0B"
    assert gguf.capabilities("llama", None, "{% if tools %}...<think>") == [
        "completion", "tools", "thinking"]
    assert gguf.capabilities("nomic-bert", 1, "") == ["embedding"]
    assert gguf.capabilities("qwen2", 3, "") == ["completion", "embedding"]
    assert with_args(read_meta(str(tiny)), "--mmproj /m/proj.gguf --ctx-size 512").capabilities == [
        "completion", "vision"]


def test_llama_servers_props_correct_what_the_file_says():
    from appliance.node.engines.llamacpp import props_capabilities

    props = {"modalities": {"vision": True, "audio": False},
             "chat_template_caps": {"supports_tools": False, "supports_tool_calls": False}}
    assert props_capabilities(["completion", "tools"], props) == ["completion", "vision"]
    on = {"modalities": {"vision": False},
          "chat_template_caps": {"supports_tools": True, "supports_tool_calls": True}}
    assert props_capabilities(["completion", "vision"], on) == ["completion", "tools"]
    assert props_capabilities(["completion"], {"modalities": "odd"}) == ["completion"]
