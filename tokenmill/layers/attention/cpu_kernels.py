"""Builds and loads the C attention kernels for CPU (paged_attention.c) through ctypes.

Compiled once per machine with the system C compiler (`-O3 -march=native -fopenmp`) into the tokenmill
cache directory, keyed by the source, the flags and the CPU's feature flags, so a warm start only loads the
shared object (milliseconds). The library links libgomp by its soname, so inside a process that has imported
torch it shares torch's OpenMP runtime and thread pool instead of starting a second one that would spin
against it. Without a compiler, or with TOKENMILL_CPU_KERNELS=0, `load()` returns None and attention uses
the pure-torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Optional

import torch

from tokenmill.config import cache_root

logger = logging.getLogger("tokenmill")

_SOURCE = os.path.join(os.path.dirname(__file__), "paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_UNLOADED = object()
_lib = _UNLOADED


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build() -> str:
    with open(_SOURCE, "rb") as f:
        src = f.read()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    key = hashlib.sha256(src + " ".join([cc] + _FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_root(), "kernels")
    target = os.path.join(out_dir, f"paged_attention-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, _SOURCE, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: concurrent builders never see a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load() -> Optional[ctypes.CDLL]:
    """The compiled kernel library, or None when it cannot be built (logged once)."""
    global _lib
    if _lib is not _UNLOADED:
        return _lib
    _lib = None
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(_build())
    except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
        logger.warning("CPU attention kernel unavailable (%s); using torch SDPA", e)
        return None
    i64, i32p, vp = ctypes.c_int64, ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p
    for fn in (lib.paged_attention_f32, lib.paged_attention_bf16):
        fn.argtypes = [vp, vp, vp, vp, i32p, i64, i32p, i32p, i32p, i64, i64, i64, i64, i64, i64,
                       ctypes.c_float, ctypes.c_int]
        fn.restype = None
    _lib = lib
    return lib


_FUNCS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _FUNCS and load() is not None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    req_of: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, Hq, D]; k/v cache [Hkv, num_blocks, block_size, D]; int32 block_table [B, nb]; int32 per-token
    request row and key range [kv_start, kv_end). Returns [Tq, Hq, D]."""
    lib = load()
    q = q.contiguous()
    out = torch.empty_like(q)
    Tq, Hq, D = q.shape
    Hkv, _, bs, _ = k_cache.shape
    assert k_cache.is_contiguous() or k_cache.stride(1) == bs * D  # blocks of one head are dense
    as_i32 = lambda t: ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_int32))  # noqa: E731
    getattr(lib, _FUNCS[q.dtype])(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), as_i32(block_table),
        block_table.stride(0), as_i32(req_of), as_i32(kv_start), as_i32(kv_end), Tq, Hq, Hkv, D,
        k_cache.stride(0), bs, scale, torch.get_num_threads())
    return out
