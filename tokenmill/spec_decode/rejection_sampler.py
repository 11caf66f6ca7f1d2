"""Speculative sampling that keeps the target distribution exactly.

Request b brings k_b draft tokens d_1..d_k and k_b + 1 rows of target logits (row j scores the token after
d_j; row 0 the token after the last known one). Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j))
while all before it were; at the first rejection the emitted token comes from the residual max(0, p_j - q_j)
(renormalised); if every draft is accepted, a bonus token comes from p_k. Each emitted token is then
distributed exactly as p (Leviathan et al. 2023, Chen et al. 2023). q is the drafter's proposal
distribution; when the drafter proposes deterministically (n-gram, greedy drafts) q is one-hot at d_j, so
acceptance is p_j(d_j) and the residual is p_j without d_j. Greedy rows reduce to exact match: accept while
d_j == argmax p_j, then emit the argmax at the first mismatch (or the bonus row).

Everything is batched: one pass over the padded [B, K] draft grid, one draw per emitted final token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tokenmill.layers import cpu_fused
from tokenmill.layers.sampler import SamplingMetadata, sampling_probs


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]    # per request: the accepted drafts, then the recovered or bonus token
    num_accepted: list[int]       # per request: accepted drafts (len(token_ids[b]) - 1)
    rows: torch.Tensor            # [sum(k+1)] the token emitted at each logits row (rows past the end: junk)


def rejection_sample(logits: torch.Tensor, num_draft: list[int], draft_token_ids: torch.Tensor,
                     md: SamplingMetadata, greedy: torch.Tensor, draft_probs: Optional[torch.Tensor] = None,
                     generator: Optional[torch.Generator] = None,
                     generators: Optional[dict[int, torch.Generator]] = None) -> RejectionOutput:
    """logits [sum(k_b + 1), V]: target logits after apply_logits_processors; md describes those rows
    (temperature, top-k/top-p/min-p per row); greedy [B] per request; draft_token_ids [sum k_b];
    draft_probs [sum k_b, V] or None (one-hot proposals); generators: request index -> seeded generator."""
    dev = logits.device
    B, K = len(num_draft), max(num_draft, default=0)
    k, row_start, draft_start, valid, draft_idx, drafts, rows = _layout(num_draft, draft_token_ids, dev)

    greedy_tokens = cpu_fused.argmax(logits)
    all_greedy = bool(greedy.all())
    probs = None if all_greedy else sampling_probs(logits, md)

    accept = valid & (greedy_tokens[rows.clamp(max=logits.shape[0] - 1)] == drafts) if K else valid
    if probs is not None and K:
        p = probs[rows.clamp(max=logits.shape[0] - 1), drafts]     # [B, K]
        q = draft_probs[draft_idx, drafts] if draft_probs is not None else torch.ones_like(p)
        u = _uniform((B, K), num_draft, dev, generator, generators)
        random_accept = valid & (u * q < p)
        accept = torch.where(greedy[:, None], accept, random_accept)
    num_acc = accept.long().cumprod(1).sum(1) if K else torch.zeros(B, dtype=torch.long, device=dev)

    final_rows = row_start + num_acc
    final = greedy_tokens[final_rows]
    if probs is not None:
        target = probs[final_rows]                                   # [B, V]
        rejected = num_acc < k
        at = torch.where(rejected, draft_start + num_acc, 0)
        if draft_probs is not None:
            q_rows = draft_probs[at] * rejected[:, None]
        else:
            q_rows = torch.zeros_like(target)
            if K:
                rej_tok = drafts.gather(1, num_acc.clamp(max=max(K - 1, 0))[:, None])[:, 0]
                q_rows[rejected, rej_tok[rejected]] = 1.0
        residual = (target - q_rows).clamp_(min=0.0)
        # p == q (up to rounding) leaves nothing; then any token of p is as good as the residual's.
        empty = residual.sum(-1, keepdim=True) <= 0
        residual = torch.where(empty, target, residual)
        race = _exponential(residual.shape, dev, generator, generators)
        final = torch.where(greedy, final, (residual / race).argmax(-1))

    num_acc_l = num_acc.tolist()
    drafts_l = drafts.tolist()
    final_l = final.tolist()
    token_ids = [drafts_l[b][:num_acc_l[b]] + [final_l[b]] for b in range(B)]
    row_tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=dev)
    if K:
        row_tokens[rows[valid]] = drafts[valid]
    row_tokens[final_rows] = final
    return RejectionOutput(token_ids, num_acc_l, row_tokens)


def _layout(num_draft: list[int], draft_token_ids: torch.Tensor, dev) -> tuple[torch.Tensor, ...]:
    """Where each request's drafts and logits rows are: k [B] drafts per request, row_start [B] its first
    logits row, draft_start [B] its first draft, valid [B, K] (j < k_b), draft_idx [B, K] into
    draft_token_ids, drafts [B, K] the draft tokens, rows [B, K] the row that scores draft j."""
    B, K = len(num_draft), max(num_draft, default=0)
    k = torch.tensor(num_draft, dtype=torch.long, device=dev)
    row_start = torch.zeros(B, dtype=torch.long, device=dev)
    row_start[1:] = torch.cumsum(k + 1, 0)[:-1]
    draft_start = row_start - torch.arange(B, device=dev)          # = cumsum of k before b
    j = torch.arange(K, device=dev)[None, :]
    valid = j < k[:, None]                                          # [B, K]
    draft_idx = torch.where(valid, draft_start[:, None] + j, 0)
    drafts = draft_token_ids[draft_idx] if K else torch.zeros(B, 0, dtype=torch.long, device=dev)
    return k, row_start, draft_start, valid, draft_idx, drafts, row_start[:, None] + j


def _uniform(shape, num_draft, dev, generator, generators) -> torch.Tensor:
    u = torch.rand(shape, device=dev, generator=generator)
    for b, gen in (generators or {}).items():  # exactly k_b draws: a seeded stream ignores its batch
        u[b, :num_draft[b]] = torch.rand(num_draft[b], device=dev, generator=gen)
    return u


def _exponential(shape, dev, generator, generators) -> torch.Tensor:
    e = torch.empty(shape, device=dev).exponential_(generator=generator)
    for b, gen in (generators or {}).items():
        e[b].exponential_(generator=gen)
    return e
