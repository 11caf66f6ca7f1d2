"""CPU matmuls over quantized weights (qlinear.c through ctypes), with pure-torch fallbacks.

Routing for float-activation formats (int8 weight-only, fp8, mxfp4, nvfp4) on CPU:
- up to FUSED_MAX_ROWS rows of x (decode and small batches): the fused kernel streams the narrow weights and
  widens them in registers; this is where quantization pays, since those steps are bound by weight bytes;
- more rows (prefill chunks): the weights are widened to a float32 copy once per call and MKL runs the GEMM
  (compute-bound there; the widening is a few percent of the GEMM).
In batch-invariant mode every row count takes the fused kernel (its reduction order per output is fixed).
Without the C library (no compiler, TOKENMILL_CPU_KERNELS=0) or off CPU, the weight is dequantized with torch
ops and F.linear runs: correct everywhere, fast nowhere.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers import batch_invariant
from tokenmill.layers.cpu_build import load_library
from tokenmill.layers.quantization import fp4_codec

_SOURCE = os.path.join(os.path.dirname(__file__), "qlinear.c")
QFMT_INT8, QFMT_FP8, QFMT_MXFP4, QFMT_NVFP4 = 0, 1, 2, 3
FUSED_MAX_ROWS = 64


def load():
    lib = load_library("qlinear", [_SOURCE])
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.qlinear_f32.argtypes = [i32, vp, i64, vp, vp, vp, i64, i64, i64, f32, vp, vp, i32, i32]
        lib.qdequant_f32.argtypes = [i32, vp, vp, vp, i64, i64, i64, f32, vp, i32]
        lib.int8_linear_iq.argtypes = [vp, i64, i32, vp, vp, i64, i64, vp, vp, i32]
        for fn in (lib.qlinear_f32, lib.qdequant_f32, lib.int8_linear_iq):
            fn.restype = None
        lib._typed = True
    return lib


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def available() -> bool:
    return load() is not None


def dequantize(fmt: int, w: torch.Tensor, scales: Optional[torch.Tensor], row_scale: Optional[torch.Tensor],
               K: int, group: int = 0, global_scale: float = 1.0) -> torch.Tensor:
    """The float32 [N, K] weight a packed one stands for (C kernel; torch reference where unavailable)."""
    lib = load() if w.device.type == "cpu" else None
    if lib is None:
        return _torch_dequantize(fmt, w, scales, row_scale, K, group, global_scale)
    N = w.shape[0]
    out = torch.empty(N, K, dtype=torch.float32)
    lib.qdequant_f32(fmt, w.data_ptr(), _ptr(scales), _ptr(row_scale), N, K, group, global_scale, out.data_ptr(),
                     torch.get_num_threads())
    return out


def _torch_dequantize(fmt, w, scales, row_scale, K, group, global_scale) -> torch.Tensor:
    if fmt == QFMT_INT8:
        out = w.float()
    elif fmt == QFMT_FP8:
        out = w.view(torch.float8_e4m3fn).float()
        if scales is not None and group > 0:
            out = out * scales.float().repeat_interleave(group, 1)[:, :K]
    elif fmt == QFMT_MXFP4:
        out = fp4_codec.dequantize_mxfp4(w, scales)
    else:
        out = fp4_codec.dequantize_nvfp4(w, scales, global_scale)
    return out * row_scale.float()[:, None] if row_scale is not None else out


def qlinear(fmt: int, x: torch.Tensor, w: torch.Tensor, scales: Optional[torch.Tensor],
            row_scale: Optional[torch.Tensor], K: int, group: int = 0, global_scale: float = 1.0,
            bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ dequant(w)^T (+ bias), in x's dtype."""
    lib = load() if x.device.type == "cpu" else None
    rows = x.numel() // K
    # batch-invariant mode: every row count through the kernel, whose per-row reduction order is fixed
    if lib is None or (rows > FUSED_MAX_ROWS and not batch_invariant.enabled()):
        wf = dequantize(fmt, w, scales, row_scale, K, group, global_scale).to(x.dtype)
        return F.linear(x, wf, bias)
    N = w.shape[0]
    x2 = x.reshape(rows, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    b = bias.float().contiguous() if bias is not None and bias.dtype != torch.float32 else bias
    y = torch.empty(rows, N, dtype=torch.float32)
    lib.qlinear_f32(fmt, x2.data_ptr(), rows, w.data_ptr(), _ptr(scales), _ptr(row_scale), N, K, group,
                    global_scale, _ptr(b), y.data_ptr(), int(not batch_invariant.enabled()), torch.get_num_threads())
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


ACT_QMAX_W8A8 = 127      # w8a8: activations on the int8 grid
ACT_QMAX_A16 = 32767     # int8 weight-only: activations on a 16-bit grid for the integer multiply-add


def quantize_rows(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row symmetric quantization to [-qmax, qmax]: (values as float32 [M, K], scale [M])."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    s = x2.abs().amax(dim=1) / qmax
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x2 * (1.0 / s)[:, None]).clamp_(-qmax, qmax), s  # times the reciprocal, like the kernel


def int8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None,
                act_qmax: int = ACT_QMAX_W8A8) -> torch.Tensor:
    """int8 weights [N, K] (per-row scale) times activations quantized per row to [-act_qmax, act_qmax],
    accumulated exactly in integers (CPU kernel), in x's dtype."""
    K = w.shape[1]
    rows = x.numel() // K
    lib = load() if x.device.type == "cpu" else None
    if lib is None:
        q, s = quantize_rows(x, act_qmax)
        if x.device.type == "cuda" and act_qmax <= 127 and rows > 16:
            acc = torch._int_mm(q.to(torch.int8), w.t()).float()  # cuBLAS int8 GEMM (needs M > 16)
        else:
            acc = q @ w.float().t()
        y = acc * s[:, None] * w_scale.float()[None, :]
        y = (y + bias.float()) if bias is not None else y
        return y.reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
    N = w.shape[0]
    x2 = x.reshape(rows, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    b = bias.float().contiguous() if bias is not None and bias.dtype != torch.float32 else bias
    y = torch.empty(rows, N, dtype=torch.float32)
    lib.int8_linear_iq(x2.data_ptr(), rows, act_qmax, w.data_ptr(), w_scale.data_ptr(), N, K, _ptr(b),
                       y.data_ptr(), torch.get_num_threads())
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


# -- bound calls: a layer's packed weights tied to the kernel once ------------------------------------------
# A decode step makes ~200 small matmul calls; the generic wrappers above cost ~15 us of Python each, the bound
# closures below ~5 us (shape/dtype checks once per layer, weight pointers captured).
def _float_bias(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The bias as float32; the caller holds the result through the kernel call (a temporary's data_ptr
    would point at freed memory, which the kernel's own scratch allocation can reuse)."""
    return bias if bias is None or bias.dtype == torch.float32 else bias.float().contiguous()


def bind_int8(w: torch.Tensor, w_scale: torch.Tensor, act_qmax: int):
    """run(x, bias) for int8_linear on CPU, or None where the kernel is unavailable."""
    lib = load() if w.device.type == "cpu" else None
    if lib is None:
        return None
    fn, (N, K) = lib.int8_linear_iq, w.shape
    wp, sp = w.data_ptr(), w_scale.data_ptr()

    def run(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        b = _float_bias(bias)
        y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
        fn(x2.data_ptr(), x2.numel() // K, act_qmax, wp, sp, N, K, _ptr(b), y.data_ptr(),
           torch.get_num_threads())
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    return run


def bind_qlinear(fmt: int, w: torch.Tensor, scales: Optional[torch.Tensor], row_scale: Optional[torch.Tensor],
                 K: int, group: int = 0, global_scale: float = 1.0):
    """run(x, bias) for qlinear on CPU (any row count: the caller routes prefill-sized batches), or None."""
    lib = load() if w.device.type == "cpu" else None
    if lib is None:
        return None
    fn, N = lib.qlinear_f32, w.shape[0]
    wp, sp, rp = w.data_ptr(), _ptr(scales), _ptr(row_scale)

    def run(x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        x2 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        b = _float_bias(bias)
        y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
        fn(fmt, x2.data_ptr(), x2.numel() // K, wp, sp, rp, N, K, group, global_scale, _ptr(b),
           y.data_ptr(), int(not batch_invariant.enabled()), torch.get_num_threads())
        return y if x.dtype == torch.float32 else y.to(x.dtype)
    return run
