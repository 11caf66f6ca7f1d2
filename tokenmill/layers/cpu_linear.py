"""Matmuls on CPU, routed by row count (float32; measured on this class of machine, see the issue notes):

- at most SKINNY_ROWS rows (decode of a few requests): the weight-streaming C kernel in skinny_linear.c,
  near the memory bandwidth, about 2x torch's GEMV;
- up to PACKED_MAX_ROWS rows (batched decode): oneDNN with the weight pre-packed once into its blocked layout
  (1.2-2x torch's GEMM at 16-128 rows, where MKL's per-call packing is not amortised);
- more rows (prefill chunks): F.linear (MKL), which is as fast or faster there.

The packed copy doubles a layer's weight memory, so it is made only while the packed total stays under
PACK_BUDGET_FRACTION of the machine's RAM (small models on CPU are exactly the case it helps).

In batch-invariant mode every CPU float32/bfloat16 matmul uses the C kernel, whatever the row count: its
per-element reduction order is fixed (see skinny_linear.c).
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import batch_invariant
from tokenmill.layers.cpu_build import load_library

logger = logging.getLogger("tokenmill")

_SOURCE = os.path.join(os.path.dirname(__file__), "skinny_linear.c")
SKINNY_ROWS = 8
PACKED_MAX_ROWS = 512
PACK_BUDGET_FRACTION = 0.15
_packed_bytes = 0


def _load():
    lib = load_library("skinny_linear", [_SOURCE])
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        for fn in (lib.skinny_linear_f32, lib.skinny_linear_bf16):
            fn.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
            fn.restype = None
        lib._typed = True
    return lib


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def pack(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A oneDNN-packed copy of a CPU float32 [N, K] weight for `linear`, or None where it does not apply."""
    global _packed_bytes
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available()
            or os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0"):
        return None
    nbytes = weight.numel() * 4
    if _packed_bytes + nbytes > PACK_BUDGET_FRACTION * _ram_bytes():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
    except (RuntimeError, AttributeError) as e:  # an older torch or a build without oneDNN
        logger.debug("oneDNN weight packing unavailable: %s", e)
        return None
    _packed_bytes += nbytes
    return packed


def available() -> bool:
    return _load() is not None


_KERNELS = {torch.float32: "skinny_linear_f32", torch.bfloat16: "skinny_linear_bf16"}


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           packed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), routed to the fastest CPU path for x's row count (see the module doc)."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if batch_invariant.enabled() and x.dtype in _KERNELS:
        return kernel_linear(x, weight, bias)
    if x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows <= SKINNY_ROWS and weight.is_contiguous() and _load() is not None:
        return kernel_linear(x, weight, bias)
    if packed is not None and rows <= PACKED_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)
