"""Write a tiny llama-architecture GGUF with random weights, and a copy llama.cpp refuses.

Theory of operation: real llama.cpp needs a real model file, and the tests may download
nothing, so this makes one: n_embd 64, 2 layers, 4 heads, n_ff 128, context 256, all F32,
weights drawn from a seeded generator (same seed, same bytes), about 0.5 MB. Its
tokenizer is llama's (sentencepiece-style): `<unk>`, `<s>`, `</s>`, all 256 byte tokens
`<0x00>`..`<0xFF>` (without them llama.cpp fails with "Byte token for <0x..> is not
set"), and a few dozen word pieces so that generated text is mostly printable. A small
chat template is in the file, so `/v1/chat/completions` works without a chat format.
It generates gibberish at thousands of tokens per second on a CPU.

The `kev` copy is the same model with `general.architecture = kev`: llama.cpp exits with
"unknown model architecture: 'kev'", the failure the model-parking seed is about.

    python tests/harness/make_gguf.py DIR [--seed N]   ->  DIR/tiny.gguf, DIR/tiny-kev.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

N_EMBD, N_LAYER, N_HEAD, N_FF, N_CTX = 64, 2, 4, 128, 256
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ("the of and to in is it you that he was for on are with as his they at be this from "
         "have or by one had not but what all were when we there can an your which their said").split()
# sentencepiece token types (llama.cpp's LLAMA_TOKEN_TYPE_*)
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


def vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(ord("a"),
                                                 ord("z") + 1)] + list(".,!?") + [f"\u2581{w}"
                                                                                  for w in WORDS]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    # Longer pieces score higher, so the tokenizer prefers whole words over letters.
    scores = [0.0] * (3 + 256) + [float(len(p)) - 10.0 for p in pieces]
    return tokens, scores, types


def write(path: str | Path, *, seed: int = 0, arch: str = "llama") -> Path:
    """Write one model; `arch` other than llama gives a file llama.cpp will not load."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, scores, types = vocab()
    n_vocab = len(tokens)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    out = gguf.GGUFWriter(str(path), arch)
    out.add_name("appliance-tiny")
    out.add_context_length(N_CTX)
    out.add_embedding_length(N_EMBD)
    out.add_block_count(N_LAYER)
    out.add_feed_forward_length(N_FF)
    out.add_head_count(N_HEAD)
    out.add_head_count_kv(N_HEAD)
    out.add_rope_dimension_count(N_EMBD // N_HEAD)
    out.add_layer_norm_rms_eps(1e-5)
    out.add_file_type(gguf.LlamaFileType.ALL_F32)
    out.add_tokenizer_model("llama")
    out.add_token_list(tokens)
    out.add_token_scores(scores)
    out.add_token_types(types)
    out.add_unk_token_id(0)
    out.add_bos_token_id(1)
    out.add_eos_token_id(2)
    out.add_add_bos_token(True)
    out.add_add_eos_token(False)
    out.add_chat_template(CHAT_TEMPLATE)
    # numpy shape (rows, cols) = (out features, in features); GGUF stores it reversed.
    out.add_tensor("token_embd.weight", w(n_vocab, N_EMBD))
    for i in range(N_LAYER):
        out.add_tensor(f"blk.{i}.attn_norm.weight", ones(N_EMBD))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out.add_tensor(f"blk.{i}.{name}.weight", w(N_EMBD, N_EMBD))
        out.add_tensor(f"blk.{i}.ffn_norm.weight", ones(N_EMBD))
        out.add_tensor(f"blk.{i}.ffn_gate.weight", w(N_FF, N_EMBD))
        out.add_tensor(f"blk.{i}.ffn_up.weight", w(N_FF, N_EMBD))
        out.add_tensor(f"blk.{i}.ffn_down.weight", w(N_EMBD, N_FF))
    out.add_tensor("output_norm.weight", ones(N_EMBD))
    out.add_tensor("output.weight", w(n_vocab, N_EMBD))
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    return path


def write_pair(directory: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    """DIR/tiny.gguf (loads) and DIR/tiny-kev.gguf (architecture `kev`: refused)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return write(directory / "tiny.gguf", seed=seed), write(directory / "tiny-kev.gguf", seed=seed,
                                                            arch="kev")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    for p in write_pair(opts.directory, seed=opts.seed):
        print(p, p.stat().st_size)


if __name__ == "__main__":
    main()
