"""Offline throughput of the engine (`tokenmill bench offline`, `benchmarks/offline_throughput.py`).

Workload: N requests (256; --quick 64), random prompts of 64-512 tokens, 64-256 output tokens (by default),
ignore_eos.
Optionally transformers `generate` on the same workload in the same run: static left-padded batches of 32
on a fixed 64-request subset (its rate counts only the tokens each request asked for). Also: single-stream
decode tok/s and its fraction of the memory roofline (weight bytes per token x tok/s / bandwidth measured
in this run).
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import time
from typing import Any, Optional

from tokenmill import SamplingParams

logger = logging.getLogger("tokenmill")


def random_workload(n: int, vocab: int, in_range=(64, 512), out_range=(64, 256), seed: int = 0):
    """n requests of random token ids: (prompt_ids, output_len)."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
            for _ in range(n)]


def weight_bytes(model) -> int:
    """Bytes a decode step streams: every parameter once (a tied embedding/head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def model_weight_bytes(worker) -> int:
    """A rank's weight bytes (collective_rpc; their sum counts the parameters every rank replicates once each)."""
    return weight_bytes(worker.model)


def load_average() -> float:
    return os.getloadavg()[0]


def run_tokenmill(llm, workload) -> dict[str, float]:
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != sum(n for _, n in workload):
        raise RuntimeError(f"the engine produced {n_out} tokens, the workload asked for {sum(n for _, n in workload)}")
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "total_tok_s": (n_out + sum(len(p) for p, _ in workload)) / dt}


def run_single_stream(llm, prompt_len: int = 128, out_len: int = 128) -> dict[str, float]:
    """Decode rate of one request alone: time from its first to its last token."""
    from tokenmill.messages import EngineCoreRequest  # messages and step (~9 ms): `bench --help` imports this module

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    vocab = llm.config.model.hf_config.vocab_size
    eng.add_request(EngineCoreRequest("single", [(1000 + i) % vocab for i in range(prompt_len)], sp, None))
    t0 = time.perf_counter()
    eng.step()  # prefill + first token
    t1 = time.perf_counter()
    n = 1
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    t2 = time.perf_counter()
    return {"ttft_s": t1 - t0, "decode_tok_s": (n - 1) / (t2 - t1)}


def run_transformers(model_dir: str, dtype, workload, batch_size: int = 32) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    useful, t = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload), batch_size):
            batch = workload[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(batch):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            max_new = max(n for _, n in batch)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                           do_sample=False, pad_token_id=0)
            useful += sum(n for _, n in batch)
    dt = time.perf_counter() - t
    return {"seconds": dt, "useful_output_tokens": useful, "output_tok_s": useful / dt}


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def add_offline_args(p: argparse.ArgumentParser, compare_transformers: bool) -> None:
    """Flags shared by `tokenmill bench offline` and the benchmarks script (which compares against
    transformers by default; the CLI does not)."""
    p.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU has AVX512-BF16, else float32")
    p.add_argument("--num-requests", type=int, default=256, help="requests in the workload")
    p.add_argument("--quick", action="store_true", help="64 requests")
    p.add_argument("--max-num-seqs", type=int, default=256, help="engine: most requests running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine: most tokens in one step")
    p.add_argument("--input-range", type=_range, default=(64, 512), metavar="MIN,MAX", help="prompt tokens")
    p.add_argument("--output-range", type=_range, default=(64, 256), metavar="MIN,MAX", help="output tokens")
    p.add_argument("--single-stream-len", type=int, default=128,
                   help="prompt and output tokens of the single-stream decode measurement")
    p.add_argument("--seed", type=int, default=0, help="seed of the random workload")
    p.add_argument("--compare-transformers", action=argparse.BooleanOptionalAction, default=compare_transformers,
                   help="also run transformers generate on a subset of the same workload")
    p.add_argument("--skip-transformers", dest="compare_transformers", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--hf-requests", type=int, default=64, help="size of the transformers subset")
    p.add_argument("--save-result", default=None, metavar="FILE.json", help="also write the JSON result here")


def run_offline(model: Optional[str], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    # The engine and the kernels import torch, perf.hardware takes ~3 ms: `bench --help` imports this module
    from tokenmill import LLM
    from tokenmill.perf.hardware import copy_bandwidth, read_bandwidth
    from tokenmill.worker.kernels_report import kernels_required

    n = 64 if args.quick else args.num_requests
    bw = copy_bandwidth()
    read_bw = read_bandwidth()
    load_before = load_average()
    kw: dict[str, Any] = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    with kernels_required():  # no throughput figure from a slow path
        llm = LLM(model, **kw)
    vocab = llm.config.model.hf_config.vocab_size
    workload = random_workload(n, vocab, args.input_range, args.output_range, seed=args.seed)
    llm.generate([{"prompt_token_ids": workload[0][0]}], use_tqdm=False)  # warm-up

    tm = run_tokenmill(llm, workload)
    logger.info("tokenmill: %s", tm)
    single = run_single_stream(llm, args.single_stream_len, args.single_stream_len)
    logger.info("single stream: %s", single)
    wbytes = sum(llm.engine.executor.collective_rpc(model_weight_bytes))
    single["weight_bytes_per_token"] = wbytes
    single["copy_roofline_frac"] = wbytes * single["decode_tok_s"] / bw
    single["read_roofline_frac"] = wbytes * single["decode_tok_s"] / read_bw
    dtype = llm.config.model.torch_dtype
    model_dir = llm.config.model.model_dir
    del llm

    result: dict[str, Any] = {
        "model": model or "default (SmolLM2-135M-Instruct)", "dtype": str(dtype).removeprefix("torch."),
        "num_requests": n, "tokenmill": tm, "single_stream": single, "copy_bandwidth_gb_s": bw / 1e9,
        "read_bandwidth_gb_s": read_bw / 1e9, "threads": torch.get_num_threads()}
    if args.compare_transformers:
        hf = run_transformers(model_dir, dtype, workload[:args.hf_requests])
        result["transformers"] = hf
        result["ratio_vs_transformers"] = tm["output_tok_s"] / hf["output_tok_s"]
    result["load_average"] = [load_before, load_average()]
    return result


def summary_line(result: dict[str, Any]) -> str:
    tm, single = result["tokenmill"], result["single_stream"]
    return (f"tokenmill {tm['output_tok_s']:.1f} out tok/s ({result['num_requests']} reqs, {result['dtype']})"
            + (f" vs transformers {result['transformers']['output_tok_s']:.1f} -> "
               f"{result['ratio_vs_transformers']:.2f}x" if "transformers" in result else "")
            + f"; single stream {single['decode_tok_s']:.1f} tok/s = {single['copy_roofline_frac']:.0%} of copy "
            f"roofline ({result['copy_bandwidth_gb_s']:.1f} GB/s); load {result['load_average'][0]:.1f}")
