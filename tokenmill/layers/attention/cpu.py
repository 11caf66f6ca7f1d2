"""Attention over the paged cache with torch SDPA (the CPU path; also correct on CUDA).

Decodes (query length 1) of all requests run as one batched SDPA over their gathered KV, with the query
heads grouped by KV head so GQA needs no repeated K/V. Prefill chunks run one SDPA per request: a chunk
starting at position 0 attends to its own fresh k/v (causal), a later chunk gathers its context from the
cache with an offset causal mask.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata


class _StepPlan:
    """Index tensors and masks for one step, shared by all layers (built on first use per window)."""

    def __init__(self, meta: AttentionMetadata, window: Optional[int]) -> None:
        bs = meta.block_size
        dec = [i for i in range(meta.num_reqs) if meta.query_len(i) == 1]
        self.prefills = [i for i in range(meta.num_reqs) if meta.query_len(i) > 1]
        dev = meta.slot_mapping.device
        self.dec_tokens = torch.tensor([meta.query_start_loc[i] for i in dec], dtype=torch.long, device=dev)
        self.dec_all = len(dec) == meta.num_reqs and len(dec) == int(meta.slot_mapping.numel())
        self.num_dec = len(dec)
        if dec:
            lens = torch.tensor([meta.seq_lens[i] for i in dec], device=dev)
            max_len = int(lens.max())
            nb = -(-max_len // bs)
            self.dec_blocks = meta.block_table[dec, :nb]                                 # [Bd, nb]
            key_pos = torch.arange(nb * bs, device=dev)
            mask = key_pos[None, :] < lens[:, None]
            if window is not None:
                mask &= key_pos[None, :] > (lens[:, None] - 1 - window)
            self.dec_mask = mask[:, None, None, :]                                       # [Bd,1,1,L]
        self.prefill_plans = []
        for i in self.prefills:
            q0, q1 = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            start = seq_len - (q1 - q0)
            if start == 0 and window is None:
                self.prefill_plans.append((q0, q1, None, None))
                continue
            blocks = meta.block_table[i, : -(-seq_len // bs)]
            qpos = torch.arange(start, seq_len, device=dev)[:, None]
            kpos = torch.arange(seq_len, device=dev)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            self.prefill_plans.append((q0, q1, blocks if start > 0 else None, mask))


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, window: Optional[int]):
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)

        plan = meta.cache.get(("sdpa", window))
        if plan is None:
            plan = meta.cache[("sdpa", window)] = _StepPlan(meta, window)
        out = torch.empty_like(q) if not plan.dec_all else None

        if plan.num_dec:
            G = Hq // Hkv
            qd = q if plan.dec_all else q.index_select(0, plan.dec_tokens)
            qd = qd.view(-1, Hkv, G, D)                                                  # [Bd,Hkv,G,D]
            Bd = qd.shape[0]
            kd = k_cache[plan.dec_blocks].view(Bd, -1, Hkv, D).transpose(1, 2)          # [Bd,Hkv,L,D]
            vd = v_cache[plan.dec_blocks].view(Bd, -1, Hkv, D).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.dec_mask, scale=scale)
            od = od.reshape(Bd, Hq, D)
            if plan.dec_all:
                return od
            out.index_copy_(0, plan.dec_tokens, od)

        for q0, q1, blocks, mask in plan.prefill_plans:
            qp = q[q0:q1].transpose(0, 1)                                                 # [Hq,n,D]
            if blocks is None:
                kp, vp = k[q0:q1].transpose(0, 1), v[q0:q1].transpose(0, 1)
            else:
                kp = k_cache[blocks].view(-1, Hkv, D)[: mask.shape[1]].transpose(0, 1)
                vp = v_cache[blocks].view(-1, Hkv, D)[: mask.shape[1]].transpose(0, 1)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, is_causal=mask is None,
                                                scale=scale, enable_gqa=Hq != Hkv)
            out[q0:q1] = op.transpose(0, 1)
        return out
