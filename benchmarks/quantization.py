"""Weight quantization on the default model: float32 and bf16 vs int8, w8a8, fp8, mxfp4, nvfp4, int4, in one run.

The default model is a GGUF: every configuration here starts from its dequantized float weights (its "HF form",
`--gguf-weights dequantize`), so the quantized ones quantize the same float weights. `int4` is
`--quantization int4` (ggml Q4_1 blocks, the GGUF block kernels); `int4_vs_int8` in the summary compares their
single-stream decode at the same activation dtype.

The quantized configurations keep the LM head in the model dtype (the engine's default); `int8+lm_head` is
int8 with `--quantize-lm-head`, so the int8 pair shows what quantizing the head buys in single-stream decode
(`decode_vs_best_float`: against the faster of fp32 and bf16). `int8-bf16` is int8 on a bfloat16 model: its
activations, norms and LM head are bf16 (the head half the bytes of float32's).

Per configuration: single-stream decode tok/s (one request, greedy), batched throughput (output tok/s of a
batch of requests), weight memory, the KV tokens that fit in a fixed total memory budget next to the weights,
the CPU cost of the matmuls of one decode token (all linear layers, LM head included) -- which is where the
formats without native CPU arithmetic (fp8, fp4) pay for widening their weights -- and the CPU cost of widening
all weights to float32 once, which every prefill-sized step pays before its GEMMs. The other quantized models
run float32 activations (the fast float type on CPUs without AVX512-BF16). Configurations are measured round-robin and the
best of --repeats is kept, so background load hits them alike; every claim is a ratio within this run.

Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import load_average  # noqa: E402

# (dtype, --quantization, --quantize-lm-head)
CONFIGS = [("float32", None, False), ("bfloat16", None, False), ("float32", "int8", False),
           ("float32", "int8", True), ("bfloat16", "int8", False), ("float32", "w8a8", False), ("float32", "fp8", False),
           ("float32", "mxfp4", False), ("float32", "nvfp4", False), ("float32", "int4", False),
           ("bfloat16", "int4", False), ("float32", "int4", True)]
FLOATS = ("fp32", "bf16")


def _name(dtype, q, head=False):
    float_name = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    if q is None:
        return float_name
    return q + ("-bf16" if dtype == "bfloat16" else "") + ("+lm_head" if head else "")


def _model_of(llm):
    return llm.engine.executor.collective_rpc(lambda w: w.model)[0]


def _weight_bytes(model) -> tuple[int, int]:
    """(all parameters, linear layers only: what one decode token streams)."""
    from tokenmill.layers.linear import LinearBase

    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    linear = sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, LinearBase)
                 for p in m.parameters(recurse=False))
    return total, linear


def _kv_bytes_per_token(llm) -> int:
    return llm.engine.executor.bytes_per_block() // llm.config.cache.block_size


def _one_thread(fn):
    """Run a CPU-cost measurement on one thread: process time is then the work itself, not OpenMP threads
    spinning while a busy machine keeps their partner descheduled."""
    def wrapped(*args):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args)
        finally:
            torch.set_num_threads(n)
    return wrapped


@_one_thread
@torch.inference_mode()
def _linear_ms(model, reps: int = 5) -> float:
    """CPU milliseconds (one thread) of all linear layers for one decode token."""
    from tokenmill.layers.linear import LinearBase

    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    dtype = model.embed_tokens.weight.dtype
    xs = [torch.randn(1, m.in_features, dtype=dtype) for m in layers]
    for m, x in zip(layers, xs):
        m(x)
    best = float("inf")
    for _ in range(reps):
        t = time.process_time()
        for m, x in zip(layers, xs):
            m(x)
        best = min(best, time.process_time() - t)
    return best * 1e3


@_one_thread
@torch.inference_mode()
def _widen_ms(model) -> float:
    """CPU milliseconds (one thread) to widen every quantized linear weight to float32 once: what a prefill-sized step
    (more than kernels.FUSED_MAX_ROWS rows) pays before its MKL GEMMs. 0 for float models."""
    from tokenmill.layers.linear import LinearBase

    layers = [m for m in model.modules()
              if isinstance(m, LinearBase) and hasattr(m.quant_method, "dequantized_weight")]
    if not layers:
        return 0.0
    t = time.process_time()
    for m in layers:
        m.quant_method.dequantized_weight(m)
    return (time.process_time() - t) * 1e3


def _decode_rate(llm, prompt, n_out: int) -> float:
    from tokenmill import SamplingParams

    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n_out + 1, ignore_eos=True), use_tqdm=False)
    return n_out / max(time.perf_counter() - t - prefill, 1e-9)


def _batch_rate(llm, prompts, n_out: int) -> float:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: built-in default model)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="requests in the batched-throughput run")
    ap.add_argument("--batch-tokens", type=int, default=32, help="output tokens per request in the batched run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", default="1GiB", help="total memory (weights + KV) for the KV-tokens column")
    ap.add_argument("--configs", default=None, help="comma-separated subset, e.g. fp32,bf16,int8")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch/OpenMP threads (default: torch's); 1 gives stable numbers on a loaded machine")
    ap.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.decode_tokens, args.batch, args.batch_tokens, args.repeats = 16, 4, 8, 1

    from tokenmill import LLM
    from tokenmill.host import parse_size

    budget = parse_size(args.budget)
    configs = [c for c in CONFIGS if not args.configs or _name(*c) in args.configs.split(",")]
    llms = {}
    for dtype, q, head in configs:
        llms[_name(dtype, q, head)] = LLM(args.model, dtype=dtype, quantization=q, quantize_lm_head=head,
                                          kv_cache_memory_bytes="256MiB", enable_prefix_caching=False,
                                          gguf_weights="dequantize",
                                          max_num_seqs=max(args.batch, 1))
    first = next(iter(llms.values()))
    tok = first.get_tokenizer()
    prompt = {"prompt_token_ids": tok("The history of the printing press begins in").input_ids}
    vocab = first.config.model.hf_config.vocab_size
    g = torch.Generator().manual_seed(0)
    batch = [{"prompt_token_ids": torch.randint(100, vocab, (64,), generator=g).tolist()} for _ in range(args.batch)]

    result = {"model": first.config.model.served_model_name, "threads": torch.get_num_threads(),
              "load_average_start": load_average(), "configs": {}}
    for name, llm in llms.items():
        model = _model_of(llm)
        total, linear = _weight_bytes(model)
        kv = _kv_bytes_per_token(llm)
        result["configs"][name] = {
            "dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
            "quantization": llm.config.model.quantization,
            "quantize_lm_head": llm.config.model.quantize_lm_head,
            "weight_mb": round(total / 1e6, 1), "linear_weight_mb": round(linear / 1e6, 1),
            "kv_bytes_per_token": kv, "kv_tokens_in_budget": max(0, int((budget - total) // kv)),
            "decode_matmuls_cpu_ms": round(_linear_ms(model), 2),
            "widen_all_weights_cpu_ms": round(_widen_ms(model), 1),
            "decode_tok_s": 0.0, "batch_tok_s": 0.0}
        llm.generate([prompt], None, use_tqdm=False)  # warm up: kernels built, first-call costs paid
    for _ in range(args.repeats):
        for name, llm in llms.items():
            r = result["configs"][name]
            r["decode_tok_s"] = round(max(r["decode_tok_s"], _decode_rate(llm, prompt, args.decode_tokens)), 2)
        for name, llm in llms.items():
            r = result["configs"][name]
            r["batch_tok_s"] = round(max(r["batch_tok_s"], _batch_rate(llm, batch, args.batch_tokens)), 2)
    result["load_average_end"] = load_average()
    cfg = result["configs"]
    best_float = max((cfg[b]["decode_tok_s"] for b in FLOATS if b in cfg), default=None)
    for name, r in cfg.items():
        for base in FLOATS:
            if base in cfg and name != base:
                r[f"decode_vs_{base}"] = round(r["decode_tok_s"] / cfg[base]["decode_tok_s"], 2)
                r[f"batch_vs_{base}"] = round(r["batch_tok_s"] / cfg[base]["batch_tok_s"], 2)
        if best_float and name not in FLOATS:
            r["decode_vs_best_float"] = round(r["decode_tok_s"] / best_float, 2)
    for suffix in ("", "-bf16", "+lm_head"):  # int4 against int8 at the same activation dtype and head
        if "int4" + suffix in cfg and "int8" + suffix in cfg:
            a = cfg["int4" + suffix]
            a["decode_vs_int8"] = round(a["decode_tok_s"] / cfg["int8" + suffix]["decode_tok_s"], 2)
    result["workload"] = {"decode_tokens": args.decode_tokens, "batch": args.batch, "batch_tokens": args.batch_tokens,
                          "prompt_tokens": len(prompt["prompt_token_ids"]), "batch_prompt_tokens": 64,
                          "repeats": args.repeats, "budget_bytes": budget}
    print(json.dumps(result, indent=2))
    def ratios(r):
        if "decode_vs_bf16" in r and "decode_vs_fp32" in r:
            return f" ({r['decode_vs_fp32']:.2f}x fp32, {r['decode_vs_bf16']:.2f}x bf16)"
        return ""

    parts = [f"{n} {r['decode_tok_s']:.1f} tok/s{ratios(r)}" for n, r in cfg.items()]
    print("single-stream decode: " + "; ".join(parts))
    for suffix in ("", "-bf16", "+lm_head"):
        a, b = cfg.get("int4" + suffix), cfg.get("int8" + suffix)
        if a and b:
            print(f"int4{suffix} vs int8{suffix}: decode {a['decode_tok_s']:.1f} vs {b['decode_tok_s']:.1f} tok/s "
                  f"({a['decode_vs_int8']:.2f}x), weights {a['weight_mb']} vs {b['weight_mb']} MB")
    if "int8" in cfg and "int8+lm_head" in cfg:
        a, b = cfg["int8"], cfg["int8+lm_head"]
        vs = (f" ({a['decode_vs_best_float']:.2f}x vs {b['decode_vs_best_float']:.2f}x the best float dtype)"
              if "decode_vs_best_float" in a else "")
        print(f"LM head: int8 decode {a['decode_tok_s']:.1f} tok/s with the head in the model dtype, "
              f"{b['decode_tok_s']:.1f} tok/s with it quantized{vs}; weights {a['weight_mb']} vs {b['weight_mb']} MB")


if __name__ == "__main__":
    main()
