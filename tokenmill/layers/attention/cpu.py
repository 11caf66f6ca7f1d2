"""Attention over the paged cache: a paged decode kernel (C on CPU, Triton on CUDA) plus torch SDPA for
prefills. One backend class serves both devices; only the decode kernel differs.

Decodes and other short queries of all requests run as one call of the paged kernel (cpu_kernels.py /
triton_paged.py), which reads each request's KV straight from its blocks. Without a kernel (no compiler, no
triton, other dtypes) they run as one batched SDPA over their gathered KV padded to the longest, with the
query heads grouped by KV head so GQA needs no repeated K/V. Prefill chunks run one SDPA per request: a chunk
starting at position 0 attends to its own fresh k/v (causal), a later chunk gathers its context from the
cache with an offset causal mask. Inputs are always 4-D: torch's fused CPU kernel takes only 4-D tensors
(3-D ones fall back to the unfused math path, ~10x slower).

Attention sinks (gpt-oss: a logit per query head in every softmax's denominator, with no value) go to the
paged kernels as they are; SDPA cannot take them, so the SDPA paths of a layer with sinks run the same
attention in plain torch (`_attend`, unfused: scores materialised per request; the model logs it once).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.layers import batch_invariant
from tokenmill.layers.attention import cpu_kernels
from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata


# Queries up to this many tokens run in the paged kernel, which reads a request's KV once per query token;
# longer ones gather the context once and run SDPA (the gather and the mask cost more than re-reading for a
# few tokens, e.g. the k + 1 tokens that verify k drafts).
KERNEL_MAX_QUERY_LEN = 16


class _StepPlan:
    """Index tensors and masks for one step, shared by all layers (built on first use per window/group).

    With a kernel, short queries go to it: decodes, speculative verification (k + 1 tokens) and small chunks,
    each token attending its own key range [kv_start, kv_end) in position order (in batch-invariant mode every
    token, however its prompt was chunked). The rest are prefills."""

    def __init__(self, meta: AttentionMetadata, window: Optional[int], group: int, use_kernel: bool,
                 all_tokens: bool = False) -> None:
        bs = meta.block_size
        dev = meta.slot_mapping.device
        short = KERNEL_MAX_QUERY_LEN if use_kernel else 1  # the padded SDPA fallback takes one token each
        dec = [i for i in range(meta.num_reqs) if meta.query_len(i) <= short or all_tokens]
        self.num_dec = len(dec)
        self.dec_all = len(dec) == meta.num_reqs
        self.use_kernel = use_kernel
        if dec and use_kernel:
            qsl, lens = meta.query_start_loc, meta.seq_lens
            tokens = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in dec])
            rows = np.concatenate([np.full(qsl[i + 1] - qsl[i], j) for j, i in enumerate(dec)])
            ends = np.concatenate([np.arange(lens[i] - (qsl[i + 1] - qsl[i]), lens[i]) + 1 for i in dec])
            starts = np.maximum(ends - window, 0) if window is not None else np.zeros_like(ends)
            to32 = lambda a: torch.from_numpy(a.astype(np.int32)).to(dev)  # noqa: E731
            self.dec_tokens = torch.from_numpy(tokens).to(dev)
            self.dec_block_table = meta.block_table[dec].to(torch.int32)
            self.dec_rows, self.dec_kv_start, self.dec_kv_end = to32(rows), to32(starts), to32(ends)
        elif dec:
            self.dec_tokens = torch.tensor([meta.query_start_loc[i] for i in dec], dtype=torch.long, device=dev)
            lens = torch.tensor([meta.seq_lens[i] for i in dec], device=dev)
            nb = -(-int(lens.max()) // bs)
            self.dec_blocks = meta.block_table[dec, :nb].reshape(-1)                      # [Bd*nb]
            key_pos = torch.arange(nb * bs, device=dev)
            mask = key_pos[None, :] < lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - window)
            self.dec_mask = mask[None, :, None, :]                                       # [1,Bd,1,L]
        self.prefills = []  # (q0, q1, context blocks or None, mask [G*n, s] or None)
        for i in range(meta.num_reqs):
            n = meta.query_len(i)
            if n <= short or all_tokens:
                continue
            q0, seq_len = meta.query_start_loc[i], meta.seq_lens[i]
            start = seq_len - n
            if start == 0 and window is None:
                self.prefills.append((q0, q0 + n, None, None))
                continue
            # a later chunk gathers its context from the first block its first query reads: with a window, the
            # blocks before it may have been given back (KV groups: their ids are stale)
            first = max(0, start - window + 1) // bs if window is not None and start > 0 else 0
            blocks = meta.block_table[i, first: -(-seq_len // bs)] if start > 0 else None
            qpos = torch.arange(start, seq_len, device=dev)[:, None]
            kpos = torch.arange(first * bs, seq_len, device=dev)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self.prefills.append((q0, q0 + n, blocks, mask.repeat(group, 1)))


def step_plan(meta: AttentionMetadata, window: Optional[int], group: int, use_kernel: bool) -> _StepPlan:
    """The step's plan for this window, GQA group and KV group (meta's block table), built once per step and
    shared by every layer."""
    key = ("sdpa", meta.kv_group, window, group, use_kernel)
    plan = meta.cache.get(key)
    if plan is None:
        plan = meta.cache[key] = _StepPlan(meta, window, group, use_kernel,
                                           use_kernel and batch_invariant.enabled())
    return plan


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_quant=None) -> None:
    """Store the step's k/v [T, Hkv, D] into their slots (quantized when the cache is 8-bit)."""
    Hkv, D = k.shape[1], k.shape[2]
    if kv_quant is None and k.device.type == "cpu" and cpu_kernels.write_kv(kv_cache, k, v, slot_mapping):
        return
    if kv_quant is not None:
        kv_quant.observe(k, v)
        k, v = kv_quant.quantize(k, 0), kv_quant.quantize(v, 1)
        if k.dtype.itemsize == 1 and k.dtype != torch.int8:  # fp8: copy the bytes (not every op takes fp8)
            k, v, kv_cache = k.view(torch.uint8), v.view(torch.uint8), kv_cache.view(torch.uint8)
    kv_cache[0].view(Hkv, -1, D).index_copy_(1, slot_mapping, k.transpose(0, 1))
    kv_cache[1].view(Hkv, -1, D).index_copy_(1, slot_mapping, v.transpose(0, 1))


# float32 scores one _attend call holds at most (query rows are taken in chunks beyond it): 256 MiB
SINK_SCORES_BYTES = 1 << 28


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
            sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """SDPA of q [..., n, D] against k/v [..., s, D] under a boolean mask (broadcast to [..., n, s]); with sinks
    (a logit per query row, broadcast to [..., n, 1]) the same in plain torch, the sink joining each row's softmax
    as a key whose value is zero (transformers' eager gpt-oss attention, in float32), a chunk of query rows at a
    time so the scores stay within SINK_SCORES_BYTES."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    n = q.shape[-2]
    rows = max(1, SINK_SCORES_BYTES // (4 * k.shape[-2] * q[..., 0, 0].numel()))
    if n > rows:
        def part(t: Optional[torch.Tensor], i: int) -> Optional[torch.Tensor]:
            return t[..., i:i + rows, :] if t is not None and t.shape[-2] == n else t
        return torch.cat([_attend(q[..., i:i + rows, :], k, v, part(mask, i), scale, part(sinks, i))
                          for i in range(0, n, rows)], dim=-2)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = logits.softmax(dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


class PagedAttentionBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self, device: str = "cpu", use_kernel: bool = True) -> None:
        # the decode kernel and the dtypes it takes; none -> gathered SDPA
        self.kernel, self.kernel_dtypes = None, ()
        if use_kernel and device == "cpu" and cpu_kernels.load() is not None:
            self.kernel, self.name = cpu_kernels.paged_attention, "cpu_paged"
            self.kernel_dtypes = (torch.float32, torch.bfloat16)
        elif use_kernel and device == "cuda":
            from tokenmill.layers.attention import triton_paged  # triton's import: only where it can run

            if triton_paged.available():
                self.kernel, self.name = triton_paged.paged_attention, "triton_paged"
                self.kernel_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, window: Optional[int],
                kv_quant=None, sinks: Optional[torch.Tensor] = None):
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        k_cache, v_cache = kv_cache[0], kv_cache[1]                                      # [Hkv, N, bs, D]
        write_kv(kv_cache, k, v, meta.slot_mapping, kv_quant)
        if kv_quant is None:
            load = lambda x, which: x  # noqa: E731
        else:
            load = lambda x, which: kv_quant.dequantize(x, which, q.dtype)  # noqa: E731

        plan = step_plan(meta, window, G, q.dtype in self.kernel_dtypes)
        out = None if plan.dec_all else torch.empty_like(q)

        if plan.num_dec and plan.use_kernel:
            qd = q if plan.dec_all else q.index_select(0, plan.dec_tokens)
            od = self.kernel(qd, k_cache, v_cache, plan.dec_block_table, plan.dec_rows, plan.dec_kv_start,
                             plan.dec_kv_end, scale, kv_quant, sinks)
            if plan.dec_all:
                return od
            out.index_copy_(0, plan.dec_tokens, od)
        elif plan.num_dec:
            qd = q if plan.dec_all else q.index_select(0, plan.dec_tokens)
            Bd = qd.shape[0]
            qd = qd.view(Bd, Hkv, G, D).transpose(0, 1)                                 # [Hkv,Bd,G,D]
            kd = load(k_cache.index_select(1, plan.dec_blocks), 0).view(Hkv, Bd, -1, D)  # [Hkv,Bd,L,D]
            vd = load(v_cache.index_select(1, plan.dec_blocks), 1).view(Hkv, Bd, -1, D)
            od = _attend(qd, kd, vd, plan.dec_mask, scale, None if sinks is None else sinks.view(Hkv, 1, G, 1))
            od = od.transpose(0, 1).reshape(Bd, Hq, D)
            if plan.dec_all:
                return od
            out.index_copy_(0, plan.dec_tokens, od)

        for q0, q1, blocks, mask in plan.prefills:
            n = q1 - q0
            if mask is None and sinks is not None:  # _attend takes an explicit causal mask
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril().repeat(G, 1)
            if mask is None:  # whole causal prompt in this chunk: fused causal kernel on fresh k/v
                op = F.scaled_dot_product_attention(
                    q[q0:q1].transpose(0, 1)[None], k[q0:q1].transpose(0, 1)[None], v[q0:q1].transpose(0, 1)[None],
                    is_causal=True, scale=scale, enable_gqa=G > 1)[0]                  # [Hq,n,D]
                out[q0:q1] = op.transpose(0, 1)
                continue
            if blocks is None:
                kp, vp = k[q0:q1].transpose(0, 1), v[q0:q1].transpose(0, 1)              # [Hkv,s,D]
            else:
                s = mask.shape[1]
                kp = load(k_cache.index_select(1, blocks), 0).view(Hkv, -1, D)[:, :s]
                vp = load(v_cache.index_select(1, blocks), 1).view(Hkv, -1, D)[:, :s]
            # Query heads grouped under their KV head: [1, Hkv, G*n, D] against [1, Hkv, s, D].
            qg = q[q0:q1].view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(1, Hkv, G * n, D)
            sk = None if sinks is None else sinks.view(Hkv, G, 1, 1).expand(Hkv, G, n, 1).reshape(1, Hkv, G * n, 1)
            op = _attend(qg, kp[None], vp[None], mask, scale, sk)
            out[q0:q1] = op.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, Hq, D)
        return out
