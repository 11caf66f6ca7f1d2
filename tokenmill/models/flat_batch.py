"""Packing a step's requests into the flat batch of DESIGN.md §3 (shared by the model runner and drafters).

input_ids[T], positions[T], slot_mapping[T], query_start_loc[B+1], seq_lens[B], block_table[B, nb], all
built with numpy: no per-token Python.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from tokenmill.layers.attention.base import AttentionMetadata


def block_table_array(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    nb = max(len(b) for b in block_ids)
    table = np.zeros((len(block_ids), nb), dtype=np.int64)
    for i, b in enumerate(block_ids):
        table[i, :len(b)] = b
    return table


def flat_batch(input_ids: np.ndarray, qlens: np.ndarray, starts: np.ndarray, block_table: np.ndarray,
               block_size: int, device: torch.device):
    """input_ids [T] (already packed); qlens/starts [B]; block_table [B, nb].
    Returns (input_ids tensor, AttentionMetadata, query_start_loc as numpy [B+1])."""
    B = len(qlens)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = starts + qlens
    req_of_tok = np.repeat(np.arange(B), qlens)
    positions = starts[req_of_tok] + (np.arange(T) - qsl[req_of_tok])
    slots = block_table[req_of_tok, positions // block_size] * block_size + positions % block_size
    to = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    meta = AttentionMetadata(positions=to(positions), slot_mapping=to(slots), block_table=to(block_table),
                             query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(), block_size=block_size)
    return to(np.ascontiguousarray(input_ids, dtype=np.int64)), meta, qsl
