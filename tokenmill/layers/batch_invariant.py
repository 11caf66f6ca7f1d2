"""Batch-invariant mode (--batch-invariant): a token's logits do not depend on what else shares its step.

It is a mode of the layers (DESIGN.md §3), switched on once per process before the model runs:
- every matmul runs through the C kernel in skinny_linear.c, whose reduction order per output element is fixed
  (independent of the row count, the row's position and the tiling) — see cpu_linear.py;
- attention runs every query token, prefill chunks included, through the paged kernel (one work item per
  token and KV head, keys reduced in position order), so chunking and prefix-cache hits change nothing;
- norms, softmax, rotary and activations are row-wise already; sampling uses each request's own generator.
CPU only for now (the C kernels); the engine refuses the flag where they are unavailable.
"""
from __future__ import annotations

_enabled = False


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled
