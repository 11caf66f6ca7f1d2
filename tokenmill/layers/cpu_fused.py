"""ctypes bindings of cpu_fused.c: residual add + RMSNorm, SiLU-and-multiply and rotary embedding as one C
call each on CPU (float32/bfloat16). `usable(x)` says whether a tensor takes this path; otherwise the callers
(norm.py, activation.py, rotary.py) run their torch code, which is the reference the tests compare with."""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from tokenmill.layers.cpu_build import VEC_HEADER, load_library

_SOURCE = os.path.join(os.path.dirname(__file__), "cpu_fused.c")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _load():
    lib = load_library("cpu_fused", [_SOURCE, VEC_HEADER])
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        for sfx in _SUFFIX.values():
            getattr(lib, f"add_rms_norm_{sfx}").argtypes = [vp, vp, vp, vp, vp, i64, i64, f32, i32]
            getattr(lib, f"silu_mul_{sfx}").argtypes = [vp, vp, i64, i64, i32]
            getattr(lib, f"rope_{sfx}").argtypes = [vp, i64, vp, vp, vp, i64, i64, i64, i32]
        lib.add_rms_norm_w32_bf16.argtypes = [vp, vp, vp, vp, vp, i64, i64, f32, i32]
        lib.argmax_f32.argtypes = [vp, vp, i64, i64, i32]
        lib._typed = True
    return lib


def usable(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype in _SUFFIX and not torch.is_grad_enabled()
            and available())


def rope_usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q, k [T, H, D] of one dtype, each head dense within its row (rows may be strided)."""
    return (usable(q) and k.dtype == q.dtype and q.dim() == 3 and k.dim() == 3
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k)))


def available() -> bool:
    return _load() is not None


def kernel(name: str, dtype: torch.dtype):
    """The C function `name` (add_rms_norm, silu_mul, rope) for dtype."""
    return getattr(_load(), f"{name}_{_SUFFIX[dtype]}")


def add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * norm(x + residual), x + residual), or (weight * norm(x), None) without a residual. weight: x's
    dtype (norm(.) rounded to it before the product, as Llama's RMSNorm), or float32 for bf16 x (one rounding
    after the float32 product, as Gemma's)."""
    H = x.shape[-1]
    name = "add_rms_norm" if weight.dtype == x.dtype else "add_rms_norm_w32"
    if name == "add_rms_norm_w32" and (x.dtype, weight.dtype) != (torch.bfloat16, torch.float32):
        raise ValueError(f"add_rms_norm: no kernel for {x.dtype} activations with {weight.dtype} weights")
    x = x.contiguous()
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    res_in = residual.contiguous() if residual is not None else None
    kernel(name, x.dtype)(x.data_ptr(), res_in.data_ptr() if res_in is not None else None,
                                 res_out.data_ptr() if res_out is not None else None, weight.data_ptr(),
                                 out.data_ptr(), x.numel() // H, H, eps, torch.get_num_threads())
    return out, res_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    I2 = x.shape[-1]
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], I2 // 2, dtype=x.dtype)
    kernel("silu_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // I2, I2 // 2, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, H, D] in place (its heads dense within a row; rows may be strided, e.g. a slice of
    qkv); cos/sin: float32 [max_positions, D/2], positions int64 [T]."""
    T, H, D = x.shape
    kernel("rope", x.dtype)(x.data_ptr(), x.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                         T, H, D, torch.get_num_threads())


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for float32 x [B, V] (the greedy sampler's logits): the same indices, in one vector pass
    per row where the C kernels are built; torch's otherwise (and for any other tensor)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] == 0 or not usable(x):
        return x.argmax(-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _load().argmax_f32(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out
