"""Micro-benchmark of the ggml block kernels (tokenmill/layers/quantization/ggml.c) against memory bandwidth.

Decode on a CPU is bound by the weight bytes each token reads. For each ggml type this times BlockLinear over
a model-sized set of [N, K] matrices (--mb MB of blocks, well beyond the caches) at M = 1, 8 and 32 rows of x
(bf16, as the engine runs on a CPU with native bf16; --f32 for float32, which moves the crossover) and prints
the weight bytes read per second and their fraction of the copy bandwidth (a torch copy of a 512 MB tensor
into a touched one: read + write bytes / s), the two timed in alternation so that a busy neighbour weighs on
both alike. The prefill route (M = 512: dequantized tiles + torch GEMM) is reported in GFLOP/s over a few of
the matrices. --crossover times the integer kernel against the tiled route at growing M, to place
ggml.MAX_ROWS_BF16 and MAX_ROWS_F32 (bf16 x, or float32 x with --f32).

    python benchmarks/ggml_kernels.py [--threads 2] [--mb 384] [--types Q4_0,Q4_K] [--crossover] [--f32]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from tokenmill.layers.quantization import ggml

SCALE_OFFSETS = {ggml.Q4_0: [0], ggml.Q4_1: [0, 2], ggml.Q5_0: [0], ggml.Q5_1: [0, 2], ggml.Q8_0: [0],
                 ggml.IQ4_NL: [0], ggml.Q2_K: [80, 82], ggml.Q3_K: [108], ggml.Q4_K: [0, 2], ggml.Q5_K: [0, 2],
                 ggml.Q6_K: [208], ggml.IQ4_XS: [0]}
FLOAT_DTYPES = {ggml.F32: torch.float32, ggml.F16: torch.float16, ggml.BF16: torch.bfloat16}


def random_blocks(type_id: int, N: int, K: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [N, row_bytes]: random block bytes with small finite fp16 scales (valid blocks of any type)."""
    if type_id in FLOAT_DTYPES:
        return (torch.randn(N, K) * 0.05).to(FLOAT_DTYPES[type_id]).view(torch.uint8).reshape(N, -1)
    values, nbytes = ggml.block_size(type_id)
    raw = rng.integers(0, 256, size=(N, K // values, nbytes), dtype=np.uint8)
    for o in SCALE_OFFSETS[type_id]:
        scales = (rng.uniform(-1, 1, size=(N, K // values)) * 0.01).astype(np.float16)
        raw[..., o:o + 2] = scales.view(np.uint8).reshape(N, K // values, 2)
    return torch.from_numpy(raw.reshape(N, -1))


def best_seconds(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class CopyBandwidth:
    """GB/s of copying a 512 MB tensor into another, both already touched (bytes read + bytes written)."""

    def __init__(self, mb: int = 512) -> None:
        self.src = torch.ones(mb << 18, dtype=torch.float32)
        self.dst = torch.zeros_like(self.src)

    def __call__(self) -> float:
        return 2 * self.src.numel() * 4 / best_seconds(lambda: self.dst.copy_(self.src), 1) / 1e9


def interleaved(run, copy: CopyBandwidth, reps: int) -> tuple[float, float]:
    """(best seconds of run, best copy GB/s), timed in alternation: on a shared machine a neighbour's load
    then weighs on both figures alike."""
    sec, bw = float("inf"), 0.0
    run()
    for _ in range(reps):
        bw = max(bw, copy())
        t0 = time.perf_counter()
        run()
        sec = min(sec, time.perf_counter() - t0)
    return sec, bw


def layers_for(type_id: int, mb: int, N: int, K: int, rng) -> list[ggml.BlockLinear]:
    count = max(1, round((mb << 20) / (N * ggml.row_bytes(type_id, K))))
    block = random_blocks(type_id, N, K, rng)
    # distinct copies (not views of one): every matrix's bytes come from memory, not a cache
    return [ggml.bind([ggml.Part(type_id, block.clone())], K) for _ in range(count)]


def run_type(type_id: int, args, copy: CopyBandwidth, rng) -> None:
    N, K = args.n, args.k
    layers = layers_for(type_id, args.mb, N, K, rng)
    weight_bytes = sum(ly.N * ggml.row_bytes(type_id, K) for ly in layers)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    cells = []
    for M in (1, 8, 32):
        x = torch.randn(M, K).to(dtype)
        sec, bandwidth = interleaved(lambda: [ly(x, None) for ly in layers], copy, args.reps)
        gbs = weight_bytes / sec / 1e9
        cells.append(f"M={M:<3d} {gbs:5.1f} GB/s {gbs / bandwidth:4.0%} of {bandwidth:4.1f}")
    prefill = layers[:args.prefill_layers]
    x = torch.randn(512, K).to(dtype)
    sec = best_seconds(lambda: [ly(x, None) for ly in prefill], max(2, args.reps // 3))
    gflops = 2 * 512 * N * K * len(prefill) / sec / 1e9
    mb = weight_bytes / 2**20
    print(f"{ggml.TYPE_NAMES[type_id]:7s} {mb:5.0f} MB  " + "  ".join(cells) + f"  M=512 {gflops:6.1f} GFLOP/s",
          flush=True)


def crossover(type_id: int, args, rng) -> None:
    """Integer kernel vs dequantized tiles + GEMM at growing row counts, for one layer shape."""
    N, K = args.n, args.k
    parts = ggml.bind([ggml.Part(type_id, random_blocks(type_id, N, K, rng))], K).parts  # as the engine runs them
    layer = ggml.BlockLinear(parts, K, max_rows=1 << 30)
    tiled = ggml.BlockLinear(layer.parts, K, max_rows=0)
    cells = []
    for M in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512):
        x = torch.randn(M, K).to(torch.bfloat16 if args.bf16 else torch.float32)
        t_int = best_seconds(lambda: layer(x, None), args.reps)
        t_tile = best_seconds(lambda: tiled(x, None), args.reps)
        cells.append(f"M={M} {t_int * 1e3:.2f}/{t_tile * 1e3:.2f}")
    print(f"{ggml.TYPE_NAMES[type_id]:7s} int/tiled ms: " + "  ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--mb", type=int, default=384, help="MB of weight blocks per type (beyond the caches)")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill-layers", type=int, default=2)
    p.add_argument("--f32", dest="bf16", action="store_false",
                   help="float32 x (default bf16, the engine's dtype on CPUs with native bf16)")
    p.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,F16,BF16")
    p.add_argument("--crossover", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    names = {v: k for k, v in ggml.TYPE_NAMES.items()}
    types = [names[t.strip()] for t in args.types.split(",")]
    rng = np.random.default_rng(0)
    print(f"ggml kernels: {ggml.isa()}, {args.threads} threads, N={args.n} K={args.k}, x "
          f"{'bf16' if args.bf16 else 'float32'} (the integer kernel up to each type's row limit, tiles above)")
    if args.crossover:
        for t in types:
            crossover(t, args, rng)
        return
    print("GB/s of weight bytes, and their fraction of the copy bandwidth (read + write GB/s of a 512 MB tensor "
          "copy) timed in alternation with each row")
    copy = CopyBandwidth()
    for t in types:
        run_type(t, args, copy, rng)


if __name__ == "__main__":
    main()
