"""The nano-vllm workload: 256 sequences, prompt and output lengths uniform in [100, 1024], ignore_eos, on a
Qwen3-0.6B-shape model with random weights (no hub needed), offline through tokenmill.LLM.

    python benchmarks/nano_vllm_workload.py --device cuda             # the real run, on a GPU
    python benchmarks/nano_vllm_workload.py --device cpu --tiny       # a seconds-long smoke run on CPU

Prints a JSON result and one summary line (output tok/s, total tok/s).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
TINY = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=1024)


def build_model(shape: dict, dtype: torch.dtype, out_dir: str) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**shape, torch_dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and 16 short sequences (smoke test)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tiny:
        args.num_seqs, args.min_len, args.max_len = 16, 10, 40

    from tokenmill import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        model_dir = build_model(TINY if args.tiny else QWEN3_0_6B, dtype, os.path.join(d, "qwen3-0.6b-shape"))
        build_s = time.perf_counter() - t0
        kwargs = dict(dtype=args.dtype, device=args.device, skip_tokenizer_init=True, max_num_seqs=args.num_seqs,
                      max_model_len=2 * args.max_len + 8, seed=args.seed)
        if args.max_num_batched_tokens:
            kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
        t0 = time.perf_counter()
        llm = LLM(model=model_dir, **kwargs)
        start_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    in_lens = rng.integers(args.min_len, args.max_len + 1, size=args.num_seqs)
    out_lens = rng.integers(args.min_len, args.max_len + 1, size=args.num_seqs)
    prompts = [{"prompt_token_ids": rng.integers(0, 1000, size=n).tolist()} for n in in_lens]
    params = [SamplingParams(max_tokens=int(n), ignore_eos=True, temperature=0.0) for n in out_lens]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up (kernels, allocator)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if args.device == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert out_tokens == int(out_lens.sum()), "every sequence must produce exactly its max_tokens"
    result = {"workload": "nano-vllm", "model": "Qwen3-0.6B shape (random)" if not args.tiny else "tiny",
              "device": args.device, "dtype": args.dtype, "num_seqs": args.num_seqs,
              "prompt_tokens": int(in_lens.sum()), "output_tokens": out_tokens, "seconds": secs,
              "output_tok_s": out_tokens / secs, "total_tok_s": (out_tokens + int(in_lens.sum())) / secs,
              "engine_start_s": start_s, "model_build_s": build_s,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
    print(json.dumps(result, indent=2))
    print(f"nano-vllm workload on {args.device}: {result['output_tok_s']:.0f} out tok/s, "
          f"{result['total_tok_s']:.0f} total tok/s ({args.num_seqs} seqs, {secs:.1f} s)")


if __name__ == "__main__":
    main()
