"""Qwen2-shaped GGUF files with random weights, for benchmarks/gguf_native.py (issue 30).

Shapes (Qwen2.5's): "0.5b" = hidden 896, 24 layers, 14 heads / 2 KV heads (head_dim 64), intermediate 4864;
"1.5b" = hidden 1536, 28 layers, 12 / 2 heads (head_dim 128), intermediate 8960; "7b" = hidden 3584, 28 layers,
28 / 4 heads (head_dim 128), intermediate 18944 (a 7B Q4_K_M is ~4.4 GB: a size users run, not one of the
benchmark's default files). All: vocabulary 151936, tied embeddings (Qwen2.5-7B's are not: its file holds one
more 152k-row matrix), q/k/v biases, rope_theta 1e6, rms eps 1e-6. "llama1b" is Llama 3.2 1B's instead (the
llama architecture, written random-llama-*): hidden 2048, 16 layers, 32 / 8 heads (head_dim 64), intermediate
8192, vocabulary 128256 (tied), no biases, rope_theta 5e5 with Llama 3's rope scaling as rope_freqs.weight.

Types: "q4_0", "q8_0" and the other "pure" ones, q4_1, q5_0, q5_1, q2_k, q3_k, q5_k, q6_k and iq4_xs (every
matrix, the tied embedding too, in that one type: as `llama-quantize --pure`; a K-quant or IQ4_XS needs rows that
are a multiple of 256, so the 1.5B shape), and "q4_k_m", laid out as llama.cpp's `llama-quantize Q4_K_M` does (src/llama-quant.cpp of the vendored
llama.cpp): Q4_K for most matrices; Q6_K for the tied embedding (it is the output) and for attn_v / ffn_down in
the layers `use_more_bits` picks (the first and last eighth and every third between); a matrix whose rows are not
a multiple of 256 falls back to Q5_0 (for Q4_K) or Q8_0 (for Q6_K). For the 0.5B (896-wide rows) this leaves
Q5_0 for q/k/o/gate/up, Q8_0 for the embedding and the more-bits attn_v, and Q4_K/Q6_K only for ffn_down (4864
= 19 x 256), which is what real Qwen2.5-0.5B Q4_K_M files hold.

Weights are random block bytes with a small, finite fp16 scale per block (any such bytes are a valid block:
weights of about +-0.05), seeded, so the same file comes out every time. The tokenizer is the default model's
(gpt2 BPE, 49152 tokens, pre-tokenizer "smollm") padded with unused tokens up to 151936, because llama.cpp
requires the token list to match the embedding's rows.

    python benchmarks/make_gguf.py [--dir /tmp/gguf-bench] [0.5b-q4_0 1.5b-q4_k_m ...]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

logger = logging.getLogger("tokenmill")

SHAPES = {  # name -> (hidden, layers, heads, kv heads, intermediate)
    "0.5b": (896, 24, 14, 2, 4864),
    "1.5b": (1536, 28, 12, 2, 8960),
    "7b": (3584, 28, 28, 4, 18944),
    "llama1b": (2048, 16, 32, 8, 8192),
}
VOCAB = 151936
# Llama 3.2 1B's: the llama architecture, no biases, 128256 tokens, rope_theta 5e5 with Llama 3's rope scaling
# (factor 32, as llama.cpp's converter writes it: rope_freqs.weight, each rotary frequency's divisor)
LLAMA = {"llama1b": {"vocab": 128256, "theta": 5e5,
                     "rope": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}}
QUANTS = ("q4_0", "q8_0", "q4_k_m")  # the benchmark's files (NAMES)
PURE = ("q4_0", "q8_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q5_k", "q6_k", "iq4_xs")
NAMES = tuple(f"{s}-{q}" for s in ("0.5b", "1.5b") for q in QUANTS)
# (byte offsets of the block's fp16 scales, their value): weights of roughly +-0.05 whatever the other bytes
SCALES = {"Q4_0": ((0,), 7e-3), "Q8_0": ((0,), 4e-4), "Q5_0": ((0,), 3e-3), "Q4_K": ((0, 2), 5e-5),
          "Q6_K": ((208,), 1.2e-5), "Q4_1": ((0, 2), 3e-3), "Q5_1": ((0, 2), 1.5e-3), "Q2_K": ((80, 82), 1e-3),
          "Q3_K": ((108,), 4e-4), "Q5_K": ((0, 2), 2.5e-5), "IQ4_XS": ((0,), 1.2e-5)}
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama-quant.cpp, rows not a multiple of 256
FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k": 12, "q4_k_m": 15,
              "q5_k": 17, "q6_k": 18, "iq4_xs": 30}  # llama.cpp's LLAMA_FTYPE_MOSTLY_*: what llama-bench names
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def default_dir() -> str:
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "gguf-bench")


def path_for(directory: str, name: str) -> str:
    arch = "llama" if name.split("-")[0] in LLAMA else "qwen2"
    return os.path.join(directory, f"random-{arch}-{name}.gguf")


def q4_k_m_type(name: str, layer: int, layers: int, cols: int) -> str:
    """llama.cpp's Q4_K_M choice for one matrix (name without "blk.N." / ".weight"; "token_embd" is tied)."""
    def more_bits(i: int, n: int) -> bool:
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    if name == "token_embd":
        kind = "Q6_K"
    elif name in ("attn_v", "ffn_down") and more_bits(layer, layers):
        kind = "Q6_K"
    else:
        kind = "Q4_K"
    return FALLBACK[kind] if cols % 256 else kind


def random_blocks(rng: np.random.Generator, rows: int, cols: int, kind: str):
    """Random bytes shaped as `kind` blocks, their fp16 scales overwritten with a small finite value."""
    import gguf

    t = gguf.GGMLQuantizationType[kind]
    values, nbytes = gguf.GGML_QUANT_SIZES[t]
    data = rng.integers(0, 256, size=(rows, cols // values, nbytes), dtype=np.uint8)
    offsets, scale = SCALES[kind]
    fp16 = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    for off in offsets:
        data[:, :, off:off + 2] = fp16
    return data.reshape(rows, -1), t


def _copy_tokenizer(w, vocab: int) -> None:
    """Every tokenizer.* key of the default model's GGUF; the token list padded to `vocab` with unused tokens."""
    import gguf

    from tokenmill.models.default_model import default_model_path

    src = gguf.GGUFReader(default_model_path())
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<unused_{i}>" for i in range(vocab - len(value))]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)


def _header(w, shape: str) -> None:
    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    w.add_block_count(layers)
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(LLAMA[shape]["theta"] if shape in LLAMA else 1e6)
    w.add_layer_norm_rms_eps(1e-5 if shape in LLAMA else 1e-6)
    if shape in LLAMA:
        w.add_rope_dimension_count(hidden // heads)


def write_file(path: str, shape: str, quant: str, seed: int = 0) -> None:
    import gguf

    from tokenmill.models.gguf import llama3_divisors

    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    head_dim = hidden // heads
    llama = LLAMA.get(shape)
    vocab = llama["vocab"] if llama else VOCAB
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama" if llama else "qwen2")
    w.add_name(os.path.basename(path).split(".gguf")[0])
    _header(w, shape)
    w.add_file_type(FILE_TYPES[quant])
    _copy_tokenizer(w, vocab)

    def kind(name: str, layer: int, cols: int) -> str:
        return q4_k_m_type(name, layer, layers, cols) if quant == "q4_k_m" else quant.upper()

    if llama:
        divisors = llama3_divisors(llama["theta"], head_dim, llama["rope"])
        w.add_tensor("rope_freqs.weight", divisors.astype(np.float32))
    data, t = random_blocks(rng, vocab, hidden, kind("token_embd", 0, hidden))
    w.add_tensor("token_embd.weight", data, raw_dtype=t)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name in LINEARS:
            rows, cols = shapes[name]
            data, t = random_blocks(rng, rows, cols, kind(name, i, cols))
            w.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=t)
            if name in ("attn_q", "attn_k", "attn_v") and not llama:
                w.add_tensor(f"blk.{i}.{name}.bias", (rng.standard_normal(rows) * 0.1).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def ensure(directory: str, name: str) -> str:
    """The file for `name` ("0.5b-q4_k_m", ...), written once (a partial write never takes the final name)."""
    path = path_for(directory, name)
    if not os.path.isfile(path):
        shape, quant = name.split("-")
        if shape not in SHAPES or quant not in QUANTS + PURE:
            raise ValueError(f"unknown benchmark file {name!r}; known: {', '.join(NAMES)}, or a shape with one of "
                             f"{', '.join(PURE)}")
        os.makedirs(directory, exist_ok=True)
        logger.info("writing %s", path)
        write_file(path + ".tmp", shape, quant)
        os.replace(path + ".tmp", path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", default=list(NAMES),
                   help=f"files to write (default: all of {NAMES}; also SHAPE-TYPE for a type of {PURE})")
    p.add_argument("--dir", default=default_dir())
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in a.names:
        print(ensure(a.dir, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
