"""ctypes binding of the C paged-attention kernel (paged_attention.c), built by tokenmill.layers.cpu_build."""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from tokenmill.layers.cpu_build import VEC_HEADER, load_library

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_attention.c")


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None when it cannot be built (then attention uses torch SDPA)."""
    lib = load_library("paged_attention", [_SOURCE, VEC_HEADER])
    if lib is not None and not getattr(lib, "_typed", False):
        i64, i32p, vp = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p
        for name in set(_FUNCS.values()):
            fn = getattr(lib, name)
            fn.argtypes = [vp, vp, vp, vp, i32p, i64, i32p, i32p, i32p, i64, i64, i64, i64, i64, i64,
                           ctypes.c_float, ctypes.c_int, vp, vp, vp, vp]
            fn.restype = None
        lib.write_kv.argtypes = [vp, i64, vp, i64, vp, i64, i64, i64, i64, vp]
        lib.write_kv.restype = ctypes.c_int
        lib._typed = True
    return lib


# (query dtype, cache holds bytes) -> kernel
_FUNCS = {(torch.float32, False): "paged_attention_f32", (torch.bfloat16, False): "paged_attention_bf16",
          (torch.float32, True): "paged_attention_f32_kv8", (torch.bfloat16, True): "paged_attention_bf16_kv8"}
DTYPES = (torch.float32, torch.bfloat16)


def supports(dtype: torch.dtype) -> bool:
    return dtype in DTYPES and load() is not None


def kernel(dtype: torch.dtype, quantized_cache: bool = False):
    """The C paged-attention function for queries of dtype (and an 8-bit cache)."""
    return getattr(load(), _FUNCS[(dtype, quantized_cache)])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    req_of: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor, scale: float,
                    kv_quant=None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [Tq, Hq, D]; k/v cache [Hkv, num_blocks, block_size, D] (q's dtype, or 8-bit with `kv_quant`, a
    KVCacheQuant); int32 block_table [B, nb]; int32 per-token request row and key range [kv_start, kv_end);
    sinks: a logit per query head [Hq] that joins each softmax's denominator (gpt-oss), or None.
    Returns [Tq, Hq, D]."""
    quant = kv_quant is not None
    q = q.contiguous()
    out = torch.empty_like(q)
    Tq, Hq, D = q.shape
    Hkv, _, bs, _ = k_cache.shape
    assert k_cache.is_contiguous() or k_cache.stride(1) == bs * D  # blocks of one head are dense
    as_i32 = lambda t: ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int32))  # noqa: E731
    if quant:
        scales = kv_quant.scale.contiguous()
        extra = (kv_quant.lut().data_ptr(), scales[0].data_ptr(), scales[1].data_ptr())
    else:
        extra = (None, None, None)
    sk = None if sinks is None else sinks.float().contiguous()  # held until the call returns
    kernel(q.dtype, quant)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), as_i32(block_table),
        block_table.stride(0), as_i32(req_of), as_i32(kv_start), as_i32(kv_end), Tq, Hq, Hkv, D,
        k_cache.stride(0), bs, scale, torch.get_num_threads(), *extra, None if sk is None else sk.data_ptr())
    return out


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """kv_cache [2, Hkv, num_blocks, block_size, D] (contiguous, k's dtype); k/v [T, Hkv, D] with dense heads
    (rows may be strided, e.g. slices of qkv); int64 slots. Returns False, writing nothing, where the layout
    does not fit (the caller's torch path then writes)."""
    lib = load()
    if (lib is None or kv_cache.dtype != k.dtype or v.dtype != k.dtype or not kv_cache.is_contiguous()
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()
            or any(t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in (k, v))):
        return False
    T, Hkv, D = k.shape
    es = k.element_size()
    if lib.write_kv(k.data_ptr(), k.stride(0) * es, v.data_ptr(), v.stride(0) * es, kv_cache.data_ptr(), T, Hkv,
                    D * es, kv_cache[0, 0].numel() * es, slot_mapping.data_ptr()):
        raise IndexError(f"a KV slot is outside the cache ({kv_cache[0, 0].numel() // D} slots per head)")
    return True
