"""Decode-sized float32 matmuls on CPU through the C kernel in skinny_linear.c (see there for why)."""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers.cpu_build import load_library

_SOURCE = os.path.join(os.path.dirname(__file__), "skinny_linear.c")
MAX_ROWS = 8  # beyond this MKL's blocked GEMM reuses weights across rows better than streaming


def _load():
    lib = load_library("skinny_linear", [_SOURCE])
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.skinny_linear_f32.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_int]
        lib.skinny_linear_f32.restype = None
        lib._typed = True
    return lib


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, with the C kernel for CPU float32 inputs of at most MAX_ROWS rows."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.numel() > MAX_ROWS * x.shape[-1] or not weight.is_contiguous() or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    lib = _load()
    if lib is None:
        return F.linear(x, weight, bias)
    N, K = weight.shape
    x2 = x.reshape(-1, K).contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    b = bias.contiguous().data_ptr() if bias is not None else None
    lib.skinny_linear_f32(x2.data_ptr(), weight.data_ptr(), b, y.data_ptr(), x2.shape[0], N, K,
                          torch.get_num_threads())
    return y
