"""Bidirectional (encoder) attention over the flat batch: every token of a sequence attends to every token of
the same sequence and to nothing else. No KV cache: an encoder runs each prompt whole, in one step.

The linear layers see the packed tokens only (no padding). Attention is the one place where sequences of
different lengths meet a batched kernel: sequences are taken longest first in groups whose lengths are within
GROUP_SLACK of the group's longest, each group padded to that longest and run as one batched SDPA call with a
key mask. Many short inputs thus cost a handful of calls, and padding is bounded to that slack inside attention.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

GROUP_SLACK = 0.75  # a sequence joins a group when its length is at least this fraction of the group's longest


def length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Sequence indices grouped longest first; each group's shortest is >= GROUP_SLACK x its longest."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] >= GROUP_SLACK * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def bidirectional_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: Sequence[int],
                            scale: float) -> torch.Tensor:
    """q, k, v: [T, heads, head_dim] of packed sequences (query_start_loc [B+1]); returns [T, heads, head_dim]."""
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    lengths = [e - s for s, e in zip(starts, ends)]
    if len(lengths) == 1:  # 4-D: torch's CPU flash kernel takes only batched inputs (3-D runs the math path)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           scale=scale)
        return o[0].transpose(0, 1)
    out = torch.empty_like(q)
    T = q.shape[0]
    pad_row = [T]  # gathers from the zero row appended below
    qkv = torch.cat([torch.stack([q, k, v]), q.new_zeros(3, 1, *q.shape[1:])], dim=1)  # [3, T + 1, H, D]
    for group in length_groups(lengths):
        longest = lengths[group[0]]
        index = [list(range(starts[i], ends[i])) + pad_row * (longest - lengths[i]) for i in group]
        idx = torch.tensor(index, device=q.device)                       # [G, L]
        valid = idx < T
        gq, gk, gv = qkv[:, idx].permute(0, 1, 3, 2, 4).unbind(0)        # each [G, H, L, D]
        mask = None if bool(valid.all()) else valid[:, None, None, :]
        o = F.scaled_dot_product_attention(gq, gk, gv, attn_mask=mask, scale=scale)  # [G, H, L, D]
        o = o.transpose(1, 2)                                           # [G, L, H, D]
        out[idx[valid]] = o[valid]
    return out
