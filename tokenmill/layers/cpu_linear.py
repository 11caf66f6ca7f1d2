"""Matmuls on CPU (float32 and bfloat16), through the C kernels in skinny_linear.c.

- Weights are packed once, at load, into panels of 16 output columns (`pack`); `panel_linear` then runs any row
  count as a register-blocked GEMM: about as fast as the unpacked streaming kernel for one row (decode is
  memory-bound) and faster than MKL/oneDNN from 8 rows up, in float32 and even more so in bfloat16 (torch's
  bf16 GEMM is emulated on CPUs without AVX512-BF16; here the weights widen in registers). Measured on this
  class of machine (2 cores, AVX2): 170-190 GFLOP/s at 64-512 rows vs 150-165 for oneDNN with pre-packed
  weights and 110-160 for F.linear; bf16 about 120 vs 20 for F.linear.
- Its reduction order per output element is fixed (k in order, then the bias), whatever the row count, the
  row's position or the tiling, so batch-invariant mode needs nothing else from matmuls.
- That is the AVX2 picture. Where torch's oneDNN/MKL GEMM is faster for a layer's batched or prefill row counts
  (bf16 on CPUs with native bf16 dot products: about 2x), those rows run F.linear on the layer's own weight
  instead: matmul_plan.py measures both paths per shape at load and keeps the faster (not in batch-invariant
  mode).
- Without a packed copy (no C compiler, or the copy would exceed the packing budget, PACK_BUDGET_FRACTION of
  RAM or $TOKENMILL_PACK_BUDGET_FRACTION: it doubles a layer's weight memory): the unpacked streaming kernel
  for a few rows (or every row count in batch-invariant mode, where it also has a fixed order), else F.linear.
  The engine's kernels report (kernels_report.py) names the layers left unpacked.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import batch_invariant, matmul_plan
from tokenmill.layers.cpu_build import VEC_HEADER, load_library
from tokenmill.layers.cpu_memory import advise_huge_pages


_SOURCE = os.path.join(os.path.dirname(__file__), "skinny_linear.c")
SKINNY_ROWS = 8
NP = 16  # panel width, as in skinny_linear.c
PACK_BUDGET_FRACTION = 0.15
_packed_bytes = 0


def _load():
    lib = load_library("skinny_linear", [_SOURCE, VEC_HEADER])
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in (lib.skinny_linear_f32, lib.skinny_linear_bf16, lib.panel_linear_f32, lib.panel_linear_bf16):
            fn.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
            fn.restype = None
        lib._typed = True
    return lib


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class Panels:
    """A [N, K] weight packed as [ceil(N/16), K, 16] (zero-padded columns), for panel_linear, and the measured
    plan saying which row counts torch serves better. It keeps its kernel and data pointer bound: a decode step
    makes ~120 of these calls, so per-call Python counts."""
    __slots__ = ("data", "out_features", "in_features", "kernel", "ptr", "plan", "__weakref__")

    def __init__(self, data: torch.Tensor, out_features: int,
                 plan: matmul_plan.MatmulPlan = matmul_plan.PANEL_ONLY) -> None:
        self.data, self.out_features, self.in_features = data, out_features, data.shape[1]
        self.kernel = getattr(_load(), _PANEL_KERNELS[data.dtype])
        self.ptr = data.data_ptr()
        self.plan = plan

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return panel_linear(x, self)


def pack_budget_fraction() -> float:
    """The share of RAM packed weights may take in this process (all models together)."""
    text = os.environ.get("TOKENMILL_PACK_BUDGET_FRACTION")
    try:
        fraction = PACK_BUDGET_FRACTION if text is None else float(text)
    except ValueError:
        fraction = -1.0
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"TOKENMILL_PACK_BUDGET_FRACTION must be a fraction of RAM in [0, 1], not {text!r}")
    return fraction


def packable(weight: torch.Tensor) -> bool:
    """Whether this weight has a panel kernel here (a CPU float32/bfloat16 weight, the C library built); `pack`
    then packs it if the budget has room."""
    return weight.device.type == "cpu" and weight.dtype in _PANEL_KERNELS and _load() is not None


def pack(weight: torch.Tensor) -> Optional[Panels]:
    """The panel-packed copy of a CPU float32/bfloat16 [N, K] weight, or None where it does not apply (no
    kernel for it, or no room left in the packing budget)."""
    global _packed_bytes
    if not packable(weight):
        return None
    nbytes = weight.numel() * weight.element_size()
    if _packed_bytes + nbytes > pack_budget_fraction() * _ram_bytes():
        return None
    _packed_bytes += nbytes
    panels = _panels(weight)
    weakref.finalize(panels.data, _unpacked, nbytes)  # a freed model gives its share of the budget back
    if batch_invariant.enabled():
        return panels  # fixed reduction order for every row count: never torch
    return Panels(panels.data, panels.out_features, matmul_plan.measure(weight, panels.linear))


def _panels(weight: torch.Tensor) -> Panels:
    N, K = weight.shape
    pad = -N % NP  # F.pad copies even when there is nothing to pad: a whole extra pass over the weight
    padded = F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight.detach()
    data = torch.empty((padded.shape[0] // NP, K, NP), dtype=weight.dtype)
    advise_huge_pages(data)  # before the first write, so the pages come huge (weights stream every step)
    data.copy_(padded.view(-1, NP, K).transpose(1, 2))
    return Panels(data, N)


def measured_dtype(shapes: list[tuple[int, int]], prior: torch.dtype) -> tuple[torch.dtype, str]:
    """--dtype auto for a checkpoint that names none: `prior` (what the CPU has) unless the other of float32
    and bfloat16 is clearly and repeatedly faster here (matmul_plan.choose_dtype)."""
    return matmul_plan.choose_dtype(shapes, lambda weight: _panels(weight).linear, prior)


def _unpacked(nbytes: int) -> None:
    global _packed_bytes
    _packed_bytes -= nbytes


def available() -> bool:
    return _load() is not None


_KERNELS = {torch.float32: "skinny_linear_f32", torch.bfloat16: "skinny_linear_bf16"}
_PANEL_KERNELS = {torch.float32: "panel_linear_f32", torch.bfloat16: "panel_linear_bf16"}


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight^T + bias through the C kernel (CPU, float32 or bfloat16, contiguous weight)."""
    lib = _load()
    N, K = weight.shape
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    b = bias.contiguous().data_ptr() if bias is not None else None
    getattr(lib, _KERNELS[x.dtype])(x2.data_ptr(), weight.contiguous().data_ptr(), b, y.data_ptr(), x2.shape[0],
                                    N, K, torch.get_num_threads())
    return y


def panel_linear(x: torch.Tensor, panels: Panels, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x @ weight^T + bias from the weight's panels (any row count; fixed reduction order)."""
    K, N = panels.in_features, panels.out_features
    x2 = x if x.dim() == 2 else x.reshape(-1, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()  # bf16 activations widen once here, not in the inner loop
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=torch.float32)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    panels.kernel(x2.data_ptr(), panels.ptr, bias.data_ptr() if bias is not None else None, y.data_ptr(), M, N,
                  K, torch.get_num_threads())
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], N)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[Panels] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the fastest CPU kernel available for it (see the module doc)."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if packed is not None:
        if packed.plan.torch_serves(x.numel() // x.shape[-1]) and not batch_invariant.enabled():
            return F.linear(x, weight, bias)
        return panel_linear(x, packed, bias)
    if x.dtype not in _KERNELS or not weight.is_contiguous() or _load() is None:
        return F.linear(x, weight, bias)
    if batch_invariant.enabled() or x.numel() // x.shape[-1] <= SKINNY_ROWS:
        return kernel_linear(x, weight, bias)
    return F.linear(x, weight, bias)
