"""Pooling: a prompt's final hidden states -> one embedding vector (--task embed).

mean (over all the prompt's tokens, special tokens included, as sentence-transformers' attention mask does),
cls (the first token) or last (the last token: decoders, whose last position has seen the whole prompt), then
an optional L2 normalization. Vectors leave the worker as float32 little-endian bytes: compact in a step
message and exactly what the OpenAI API's base64 encoding_format sends.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, starts: Sequence[int], ends: Sequence[int], method: str,
         normalize: bool) -> list[bytes]:
    """hidden [T, H]; sequence i is hidden[starts[i]:ends[i]] (the whole prompt for mean and cls)."""
    if method == "last":
        vecs = hidden[torch.tensor(ends, device=hidden.device) - 1].float()
    elif method == "cls":
        vecs = hidden[torch.tensor(starts, device=hidden.device)].float()
    elif method == "mean":  # one segment sum over the pooled rows, not a loop over requests
        starts_a = np.asarray(starts, dtype=np.int64)
        lens = np.asarray(ends, dtype=np.int64) - starts_a
        seg = np.repeat(np.arange(len(lens)), lens)
        rows = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens) + np.repeat(starts_a, lens)
        to = lambda a: torch.from_numpy(a).to(hidden.device)  # noqa: E731
        sums = hidden.new_zeros(len(lens), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, to(seg), hidden[to(rows)].float())
        vecs = sums / to(lens)[:, None]
    else:
        raise ValueError(f"unknown pooling method {method!r}")
    if normalize:
        vecs = F.normalize(vecs, p=2, dim=-1)
    arr = vecs.cpu().numpy().astype("<f4", copy=False)
    return [row.tobytes() for row in arr]
