"""Paged attention for CUDA in Triton: the GPU twin of paged_attention.c.

One program per (query token, KV head): it loads the G query heads that share the KV head, walks the
request's block table in tiles of BLOCK_N keys, gathers K/V slots straight from the paged cache and keeps an
online softmax in fp32 (flash-decoding style, one pass). Any query token works (decode or a prefill chunk
token: its key range is [kv_start, kv_end)), but the backend sends it decodes; prefills use SDPA's flash kernel.
Attention sinks (gpt-oss, a logit per query head with no value) start the online softmax: the running max is
the sink and the running sum exp(sink - sink) = 1, so every later rescale carries the sink's share along.

Importing this module needs triton; `available()` says whether it can run here. Tests run it on CPU under
the Triton interpreter (TRITON_INTERPRET=1) and on CUDA when a GPU is present.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(Q, K, V, O, BT, REQ, KS, KE, K_SCALE, V_SCALE, SINKS, bt_stride, q_stride_t,
                                q_stride_h, kv_stride_h, scale, G: tl.constexpr, GP: tl.constexpr,
                                D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                                QUANT: tl.constexpr, HAS_SINKS: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)
        gd_mask = (g < G)[:, None] & (d < D)[None, :]
        q_off = t * q_stride_t + (h * G + g)[:, None] * q_stride_h + d[None, :]
        q = tl.load(Q + q_off, mask=gd_mask, other=0.0).to(tl.float32) * scale
        if QUANT:  # 8-bit cache: per-head scales folded into q (K) and the output (V)
            q = q * tl.load(K_SCALE + h)
        req = tl.load(REQ + t).to(tl.int64)
        s0 = tl.load(KS + t)
        s1 = tl.load(KE + t)
        if HAS_SINKS:
            m_i = tl.load(SINKS + h * G + g, mask=g < G, other=0.0).to(tl.float32)
            l_i = tl.full([GP], 1.0, tl.float32)
        else:
            m_i = tl.full([GP], float("-inf"), tl.float32)
            l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        kv_base = h.to(tl.int64) * kv_stride_h
        for start in range(s0, s1, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            p_mask = pos < s1
            blk = tl.load(BT + req * bt_stride + pos // BS, mask=p_mask, other=0).to(tl.int64)
            slot = blk * BS + pos % BS
            kv_off = kv_base + slot[:, None] * D + d[None, :]
            kv_mask = p_mask[:, None] & (d < D)[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(tl.float32)            # [BLOCK_N, DP]
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                        # [GP, BLOCK_N]
            s = tl.where(p_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
        out = acc / l_i[:, None]
        if QUANT:
            out = out * tl.load(V_SCALE + h)
        tl.store(O + q_off, out.to(O.dtype.element_ty), mask=gd_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    req_of: torch.Tensor, kv_start: torch.Tensor, kv_end: torch.Tensor, scale: float,
                    kv_quant=None, sinks=None) -> torch.Tensor:
    """Same contract as cpu_kernels.paged_attention: q [Tq, Hq, D]; k/v cache [Hkv, num_blocks, block_size, D]
    (q's dtype, or fp8/int8 with `kv_quant`); int32 block_table [B, nb], per-token request row and key range
    [kv_start, kv_end); sinks [Hq] or None. Returns [Tq, Hq, D]."""
    q = q.contiguous()
    out = torch.empty_like(q)
    Tq, Hq, D = q.shape
    Hkv, _, bs, _ = k_cache.shape
    G = Hq // Hkv
    scales = kv_quant.scale.contiguous() if kv_quant is not None else q.new_ones(2, Hkv, dtype=torch.float32)
    sk = sinks.float().contiguous() if sinks is not None else scales[0]  # (unread without sinks)
    _paged_attention_kernel[(Tq, Hkv)](
        q, k_cache, v_cache, out, block_table, req_of, kv_start, kv_end, scales[0], scales[1], sk,
        block_table.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), scale, G=G,
        GP=triton.next_power_of_2(G), D=D, DP=triton.next_power_of_2(D), BS=bs, BLOCK_N=32,
        QUANT=kv_quant is not None, HAS_SINKS=sinks is not None)
    return out
