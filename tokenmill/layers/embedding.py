"""Vocabulary-parallel token embedding and LM head.

Both split the vocabulary into tp equal row blocks (the last one padded when tp does not divide the vocab), so
a tied head and its embedding hold the same rows on every rank. The embedding looks up the ids in its block
(others give zeros) and all-reduces; the head multiplies by its block and all-gathers the logits, dropping the
padding. With one rank both are the plain lookup and matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed import tp_all_gather, tp_all_reduce, tp_rank, tp_size
from tokenmill.layers.linear import LinearBase, Sharding, narrow


def vocab_block(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(first row, real rows, padded rows) of rank's block of the vocabulary."""
    per = -(-vocab_size // tp)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


def vocab_parallel_lookup(input_ids: torch.Tensor, start: int, rows: int, tp: int, lookup) -> torch.Tensor:
    """lookup(ids) over this rank's rows [start, start + rows) of the vocabulary: ids in another rank's block
    give zeros, and the ranks' lookups are summed (with one rank, the plain lookup)."""
    if tp == 1:
        return lookup(input_ids)
    local = input_ids - start
    outside = (local < 0) | (local >= rows)
    x = lookup(local.masked_fill(outside, 0))
    x.masked_fill_(outside[..., None], 0)
    return tp_all_reduce(x)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp_size()
        self.start, self.rows, per = vocab_block(vocab_size, self.tp, tp_rank())
        # padding rows are never looked up, but must hold finite values for a tied, padded head; the others are
        # loaded (empty: untouched pages cost no memory when a GGUF's blocks replace this module)
        self.weight = nn.Parameter(torch.empty(per, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.data[self.rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(input_ids, self.start, self.rows, self.tp,
                                     lambda ids: F.embedding(ids, self.weight))

    def load_shard(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        expected = (self.vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not fit an embedding of {expected}")
        param.data[:self.rows].copy_(narrow(loaded, 0, self.start, self.rows))


class ParallelLMHead(LinearBase):
    """logits = x W^T over the vocabulary, W's rows split as the embedding's. A linear layer like the others,
    so a quant_method can quantize it. float_logits: a method whose kernel computes in float32 (ggml blocks)
    returns the logits so, not rounded to the model dtype first."""

    float_logits = True

    def __init__(self, hidden_size: int, vocab_size: int, dtype: torch.dtype, quant_method=None) -> None:
        tp = tp_size()
        start, rows, per = vocab_block(vocab_size, tp, tp_rank())
        sharding = Sharding(hidden_size, (0, hidden_size), (vocab_size,), ((start, rows),), (per,), tp)
        super().__init__(hidden_size, per, False, dtype, quant_method, sharding)
        self.vocab_size = vocab_size
        if rows < per:
            self.weight.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, x, None)
        if self.sharding.tp == 1:
            return logits
        return tp_all_gather(logits, -1)[..., :self.vocab_size]
