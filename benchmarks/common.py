"""Shared pieces of the benchmarks: workloads, machine bandwidth, model byte counts."""
from __future__ import annotations

import os
import random
import time

import torch


def random_workload(n: int, vocab: int, in_range=(64, 512), out_range=(64, 256), seed: int = 0):
    """n requests of random token ids: (prompt_ids, output_len)."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*in_range))], rng.randint(*out_range))
            for _ in range(n)]


def copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by a large tensor copy: the memory roofline."""
    x = torch.ones(nbytes // 4)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        y.copy_(x)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 2**30, reps: int = 5) -> float:
    """Bytes read per second by torch.sum over a large bf16 tensor."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every parameter once (a tied embedding/head counts once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def load_average() -> float:
    return os.getloadavg()[0]
