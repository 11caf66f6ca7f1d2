"""Transparent huge pages for the large CPU tensors that kernels stream or index at random (the KV cache, the
packed weights).

With 4 KiB pages a decode step over a few GiB of KV cache touches blocks all over it and misses the TLB on
most of them, the first write to each page faults, and the hardware prefetcher stops at every page boundary
while streaming weights. `madvise(MADV_HUGEPAGE)` lets the kernel back the range with 2 MiB pages where the
system allows it (transparent_hugepage = always or madvise); elsewhere it is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
from typing import Optional

import torch

logger = logging.getLogger("tokenmill")

_HUGE = 2 * 2**20
_MADV_DONTNEED, _MADV_HUGEPAGE, _MADV_PAGEOUT = 4, 14, 21  # Linux
_PAGE = 4096
LAZY_ZERO_BYTES = 2 * 2**20  # a pool at least this large is zeroed by the kernel as it is touched (zeroed_tensors)
_libc = None


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages under the whole 2 MiB-aligned pages inside t's storage (CPU, Linux); True if taken."""
    if t.numel() * t.element_size() < 2 * _HUGE:
        return False
    return _madvise_inside(t, _HUGE, _MADV_HUGEPAGE) is not None


def _madvise_inside(t: torch.Tensor, page: int, advice: int) -> Optional[tuple[int, int]]:
    """madvise(advice) over the whole `page`-sized pages inside t's bytes (CPU, Linux): their address range
    [lo, hi), or None where nothing was advised."""
    libc = _libc_madvise()
    if libc is None or t.device.type != "cpu":
        return None
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // page) * page, end // page * page
    return (lo, hi) if hi > lo and libc.madvise(lo, hi - lo, advice) == 0 else None


def _libc_madvise():
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except OSError:
            _libc = False
    return _libc or None


def page_out(t: torch.Tensor) -> bool:
    """Reclaim the whole 4 KiB pages inside t's bytes (MADV_PAGEOUT, Linux 5.4+): for a view of a mapped file
    that was copied (repacked weights), its pages leave this process's resident set and a later read faults them
    back in from the file. Never loses data: anonymous memory would go to swap, or stay where there is none."""
    return _madvise_inside(t, _PAGE, _MADV_PAGEOUT) is not None


def gather_in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of these CPU tensors laid end to end (64-byte aligned) in one buffer under huge pages. A weight
    smaller than two huge pages gets none of its own (`advise_huge_pages`), yet a decode step streams all of
    them: the int8 layers of a small model read ~10% faster this way."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    buf = torch.empty(sum(sizes) + _HUGE, dtype=torch.uint8)
    start = -buf.data_ptr() % _HUGE  # from a huge-page boundary: the first weights get one too
    buf = buf[start:start + sum(sizes)]
    advise_huge_pages(buf)  # before the first write, so the pages come huge
    out, offset = [], 0
    for t, size in zip(tensors, sizes):
        nbytes = t.numel() * t.element_size()
        dst = buf[offset:offset + nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t)
        out.append(dst)
        offset += size
    return out


def zeroed_tensors(shapes: list[tuple[int, ...]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Zero-filled tensors of these shapes, views into one allocation (a KV cache's layer slots). On CPU a large
    pool is zeroed lazily (lazy_zero): it costs memory only as its blocks fill, where torch.zeros would touch
    all of it up front (seconds for GiBs, and the whole budget resident from the start); under huge pages where
    the system allows them."""
    sizes = [math.prod(shape) for shape in shapes]
    total = sum(sizes)
    flat = torch.empty(total, dtype=dtype, device=device)
    if flat.device.type == "cpu" and total * dtype.itemsize >= LAZY_ZERO_BYTES and lazy_zero(flat):
        advise_huge_pages(flat)  # before the first write, so the pages come huge
    else:
        flat.zero_()
    out, offset = [], 0
    for shape, size in zip(shapes, sizes):
        out.append(flat[offset:offset + size].view(shape))
        offset += size
    return out


def lazy_zero(t: torch.Tensor) -> bool:
    """Zero a contiguous CPU tensor without touching it: its whole pages are dropped (MADV_DONTNEED: private
    anonymous memory reads as zeros afterwards, each page faulted in fresh when first touched), the partial
    pages at its ends zeroed in place. Whatever the allocator handed out (a fresh mapping, or heap memory that
    once held other data: a large torch.empty is not always the former). False where madvise is unavailable."""
    pages = _madvise_inside(t, _PAGE, _MADV_DONTNEED) if t.is_contiguous() else None
    if pages is None:
        return False
    lo, hi = pages
    raw, start = t.view(-1).view(torch.uint8), t.data_ptr()
    raw[:lo - start].zero_()
    raw[hi - start:].zero_()
    return True
