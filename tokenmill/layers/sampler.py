"""Batched sampling: one set of tensor ops for the whole batch, whatever mix of settings it holds.

Order (as vLLM): raw log-softmax for reported logprobs -> logit bias, min_tokens ban, penalties,
structured-output token bitmask ->
greedy argmax | temperature, top-k, top-p, min-p, then an exponential race (argmax p/q, q ~ Exp(1)),
which equals sampling from p. Seeded requests draw their q from their own generator, so their samples
do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenmill.layers import cpu_fused


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor                 # [B] (1.0 for greedy rows)
    greedy: torch.Tensor                      # [B] bool
    all_greedy: bool
    top_k: Optional[torch.Tensor] = None      # [B] long, 0 = off
    top_p: Optional[torch.Tensor] = None      # [B]
    min_p: Optional[torch.Tensor] = None      # [B]
    # penalties (None when no row has one)
    repetition_penalty: Optional[torch.Tensor] = None  # [B]
    presence_penalty: Optional[torch.Tensor] = None
    frequency_penalty: Optional[torch.Tensor] = None
    prompt_tokens: Optional[torch.Tensor] = None       # [B, Lp] padded with vocab_size
    output_tokens: Optional[torch.Tensor] = None       # [B, Lo] padded with vocab_size
    banned: list[tuple[int, list[int]]] = field(default_factory=list)           # (row, ids) for min_tokens
    logit_bias: list[tuple[int, list[int], list[float]]] = field(default_factory=list)
    generators: dict[int, torch.Generator] = field(default_factory=dict)       # row -> seeded generator
    max_num_logprobs: int = -1                # -1: no row wants logprobs
    # Structured output: [B, ceil(V/32)] int32, bit j of word w allows token 32*w + j (all ones: free row).
    token_bitmask: Optional[torch.Tensor] = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # [B]
    logprob_token_ids: Optional[torch.Tensor] = None  # [B, 1 + k]: sampled, then top-k
    logprobs: Optional[torch.Tensor] = None           # [B, 1 + k]
    sampled_ranks: Optional[torch.Tensor] = None      # [B]


def _token_counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    vocab = logits.shape[1]
    out_counts = _token_counts(md.output_tokens, vocab)
    if md.repetition_penalty is not None:
        seen = out_counts > 0
        if md.prompt_tokens is not None:
            seen |= _token_counts(md.prompt_tokens, vocab) > 0
        p = md.repetition_penalty[:, None].expand_as(logits)
        penalized = torch.where(logits > 0, logits / p, logits * p)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty[:, None] * out_counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty[:, None] * (out_counts > 0).float()
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.top_k is not None or md.top_p is not None:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if md.top_k is not None:
            k = md.top_k.clamp(min=0)
            k = torch.where(k == 0, torch.full_like(k, logits.shape[1]), k)
            remove |= torch.arange(logits.shape[1], device=logits.device)[None, :] >= k[:, None]
        if md.top_p is not None:
            probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
            cum_before = probs.cumsum(-1) - probs  # mass strictly above each token
            remove |= cum_before >= md.top_p[:, None]
        remove[:, 0] = False  # always keep the best token
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(remove, float("-inf")))
    if md.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.max(-1, keepdim=True).values * md.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    B, V = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.to(logits.device)[:, :, None] >> shifts) & 1).view(B, -1)[:, :V].bool()
    return logits.masked_fill(~allowed, float("-inf"))


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min_tokens bans, penalties and the grammar bitmask: what greedy and random rows share."""
    if md.logit_bias or md.banned:
        logits = logits.clone()
        for row, ids, vals in md.logit_bias:
            logits[row, ids] += torch.tensor(vals, dtype=logits.dtype, device=logits.device)
        for row, ids in md.banned:
            logits[row, ids] = float("-inf")
    if md.output_tokens is not None:
        logits = apply_penalties(logits, md)
    if md.token_bitmask is not None:
        logits = apply_token_bitmask(logits, md.token_bitmask)
    return logits


def sampling_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: softmax of temperature-scaled, top-k/top-p/min-p filtered
    logits (after apply_logits_processors)."""
    return apply_top_k_top_p_min_p(logits / md.temperature[:, None], md).softmax(-1)


def logprobs_of(raw_logprobs: torch.Tensor, tokens: torch.Tensor, max_num_logprobs: int):
    """(ids [B, 1+k], logprobs [B, 1+k], ranks [B]) of `tokens` under raw_logprobs, then the top-k."""
    sampled_lp = raw_logprobs.gather(1, tokens[:, None])
    ranks = (raw_logprobs > sampled_lp).sum(-1) + 1
    if max_num_logprobs > 0:
        top_lp, top_ids = raw_logprobs.topk(max_num_logprobs, dim=-1)
        return torch.cat([tokens[:, None], top_ids], 1), torch.cat([sampled_lp, top_lp], 1), ranks
    return tokens[:, None], sampled_lp, ranks


def sample(logits: torch.Tensor, md: SamplingMetadata, generator: Optional[torch.Generator] = None) -> SamplerOutput:
    """logits: [B, V] float32."""
    raw_logprobs = logits.log_softmax(-1) if md.max_num_logprobs >= 0 else None
    logits = apply_logits_processors(logits, md)

    greedy_tokens = cpu_fused.argmax(logits)
    if md.all_greedy:
        tokens = greedy_tokens
    else:
        probs = sampling_probs(logits, md)
        q = torch.empty_like(probs)
        q.exponential_(generator=generator)
        for row, gen in md.generators.items():
            q[row].exponential_(generator=gen)
        random_tokens = (probs / q).argmax(-1)
        tokens = torch.where(md.greedy, greedy_tokens, random_tokens)

    out = SamplerOutput(tokens)
    if raw_logprobs is not None:
        out.logprob_token_ids, out.logprobs, out.sampled_ranks = logprobs_of(raw_logprobs, tokens,
                                                                            md.max_num_logprobs)
    return out
