"""Multi-head latent attention (DeepSeek-V2/V3) over the flat batch and a latent paged KV cache.

A token's keys and values are a function of one compressed vector: the latent c (kv_lora_rank L values, after
kv_a_layernorm) and a rope key k_pe (R values, shared by every head, after rope). The cache holds only those,
per layer `[num_blocks, block_size, L + R]` (`latent_cache_shape`): (L + R) values per token and layer instead of
2 x heads x head_dim. The up-projection kv_b [heads, nope + v, L] (`LatentUpProjection`) gives each head its
k_nope = W_uk c and v = W_uv c. Attention runs in one of two forms, equal up to rounding:

- expanded (prefill chunks, many queries): the context's latents go through kv_b to per-head keys and values,
  then SDPA. Work per context token: heads x (nope + v) x L, shared by the chunk's queries.
- absorbed (decodes): W_uk is folded into the query (q_lat = q_nope W_uk, L values per head), so scores are
  q_lat . c + q_pe . k_pe against the cached vectors themselves (one shared key "head" of width L + R, read once
  for all heads), the output is formed in latent space (P c) and W_uv maps it to each head's v. Work per query
  is independent of the context length but for the L + R wide dot products.

This is a torch implementation: a request's blocks are gathered (decodes batched, padded to the longest and
masked; prefill chunks one SDPA each). There is no paged C/Triton kernel for the latent layout yet.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.linear import narrow

PATH = "mla-torch-gathered"  # the kernels report's name for this attention path


def latent_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int) -> tuple[int, ...]:
    """One layer's latent KV cache: per slot the latent then the rope key."""
    return (num_blocks, block_size, kv_lora_rank + rope_dim)


class LatentUpProjection(nn.Module):
    """kv_b_proj: latent [L] -> per head [k_nope | v]. A plain weight, this rank's heads' rows [H * (nope + v), L]
    (not a LinearBase: the absorbed form multiplies by its halves directly, so it stays in the model dtype and no
    quantization method takes it over)."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope: int, v: int, head_start: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v, self.head_start = num_heads, nope, v, head_start
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), kv_lora_rank, dtype=dtype),
                                   requires_grad=False)

    def load_shard(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        rows = self.nope + self.v
        if loaded.shape[1] != param.shape[1] or loaded.shape[0] % rows:
            raise ValueError(f"shape {tuple(loaded.shape)} is not [heads * {rows}, {param.shape[1]}]")
        param.data.copy_(narrow(loaded, 0, self.head_start * rows, self.num_heads * rows))

    def heads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, L], W_uv [H, v, L]), views of the weight."""
        w = self.weight.view(self.num_heads, self.nope + self.v, -1)
        return w[:, :self.nope], w[:, self.nope:]

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [S, L] -> (k_nope [H, S, nope], v [H, S, v])."""
        kv = F.linear(latent, self.weight).view(-1, self.num_heads, self.nope + self.v).transpose(0, 1)
        return kv[..., :self.nope], kv[..., self.nope:]


def expanded_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, up: LatentUpProjection,
                       mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """One request's queries q_nope [n, H, nope], q_pe [n, H, R] over its context ctx [S, L + R] (latent | k_pe),
    mask [n, S] (True: attend; None: causal with S == n) -> [n, H, v], keys and values expanded per head."""
    L = up.weight.shape[1]
    k_nope, v = up.expand(ctx[:, :L])                                                  # [H, S, *]
    k = torch.cat([k_nope, ctx[None, :, L:].expand(k_nope.shape[0], -1, -1)], dim=-1)   # [H, S, nope + R]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)                              # [H, n, nope + R]
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                       scale=scale)
    return o[0].transpose(0, 1)


def absorbed_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, up: LatentUpProjection,
                       mask: torch.Tensor, scale: float) -> torch.Tensor:
    """B requests' queries q_nope [B, n, H, nope], q_pe [B, n, H, R] over their contexts ctx [B, S, L + R], mask
    [B, n, S] -> [B, n, H, v], in latent space: every head of every query token is one row attending the same
    single-"head" keys ctx (values: its latent part)."""
    B, n, H, _ = q_nope.shape
    S, C = ctx.shape[1], ctx.shape[2]
    w_uk, w_uv = up.heads()
    L = w_uk.shape[2]
    q_lat = torch.einsum("bnhk,hkl->bnhl", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe], dim=-1).reshape(B, n * H, C)
    # plain matmuls: torch's CPU SDPA took ~1.7x as long for these shapes (16 rows of 576 against 2048 keys)
    scores = torch.matmul(q, ctx.transpose(1, 2)).float() * scale                    # [B, n * H, S]
    rows_mask = mask[:, :, None, :].expand(B, n, H, S).reshape(B, n * H, S)
    probs = scores.masked_fill(~rows_mask, float("-inf")).softmax(dim=-1).to(q.dtype)
    o_lat = torch.matmul(probs, ctx[..., :L])                                          # [B, n * H, L]
    return torch.einsum("bnhl,hvl->bnhv", o_lat.view(B, n, H, L), w_uv)


class _MLAPlan:
    """Per step (shared by every layer): single-token queries (decodes) run absorbed in one batch over their
    gathered blocks; longer ones (prefill chunks, draft verification) run expanded, one request each."""

    def __init__(self, meta: AttentionMetadata) -> None:
        bs, dev = meta.block_size, meta.slot_mapping.device
        dec = [i for i in range(meta.num_reqs) if meta.query_len(i) == 1]
        self.dec_all = len(dec) == meta.num_reqs
        self.dec_tokens = torch.tensor([meta.query_start_loc[i] for i in dec], dtype=torch.long, device=dev)
        if dec:
            lens = torch.tensor([meta.seq_lens[i] for i in dec], device=dev)
            nb = -(-int(lens.max()) // bs)
            self.dec_blocks = meta.block_table[dec, :nb].reshape(-1)                      # [Bd * nb]
            self.dec_mask = (torch.arange(nb * bs, device=dev)[None, :] < lens[:, None])[:, None, :]  # [Bd, 1, S]
        self.prefills = []  # (q0, q1, context blocks, seq_len, mask [n, S] or None: causal from position 0)
        for i in range(meta.num_reqs):
            n, seq_len = meta.query_len(i), meta.seq_lens[i]
            if n == 1:
                continue
            q0, start = meta.query_start_loc[i], seq_len - n
            mask = None
            if start > 0:
                mask = torch.arange(seq_len, device=dev)[None, :] <= torch.arange(start, seq_len, device=dev)[:, None]
            self.prefills.append((q0, q0 + n, meta.block_table[i, :-(-seq_len // bs)], seq_len, mask))


def mla_forward(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                cache: torch.Tensor, meta: AttentionMetadata, up: LatentUpProjection, scale: float) -> torch.Tensor:
    """q_nope [T, H, nope], q_pe [T, H, R] (roped), latent [T, L] (normed), k_pe [T, R] (roped); cache this
    layer's [num_blocks, block_size, L + R]. Writes the step's latents into their slots first (a request may read
    blocks another one of the step writes: a shared prefix), then attends. Returns [T, H, v]."""
    C = cache.shape[-1]
    flat = cache.view(-1, C)
    flat.index_copy_(0, meta.slot_mapping, torch.cat([latent, k_pe], dim=-1).to(cache.dtype))
    key = ("mla", meta.kv_group)
    plan = meta.cache.get(key)
    if plan is None:
        plan = meta.cache[key] = _MLAPlan(meta)
    T, H = q_nope.shape[:2]
    out = q_nope.new_empty(T, H, up.v)
    if len(plan.dec_tokens):
        Bd = len(plan.dec_tokens)
        ctx = cache.index_select(0, plan.dec_blocks).view(Bd, -1, C)
        qn, qp = (q_nope, q_pe) if plan.dec_all else (q_nope[plan.dec_tokens], q_pe[plan.dec_tokens])
        od = absorbed_attention(qn[:, None], qp[:, None], ctx, up, plan.dec_mask, scale)[:, 0]
        if plan.dec_all:
            return od
        out[plan.dec_tokens] = od
    for q0, q1, blocks, seq_len, mask in plan.prefills:
        ctx = cache.index_select(0, blocks).view(-1, C)[:seq_len]
        out[q0:q1] = expanded_attention(q_nope[q0:q1], q_pe[q0:q1], ctx, up, mask, scale)
    return out
