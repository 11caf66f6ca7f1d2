"""Packing a step's requests into the flat batch of DESIGN.md §3 (shared by the model runner and drafters).

input_ids[T], positions[T], slot_mapping[T], query_start_loc[B+1], seq_lens[B], block_table[B, nb], all
built with numpy: no per-token Python. With KV groups (step/kv_groups.py), a block table and slot mapping per
group, each in its own AttentionMetadata (meta.for_layer picks a layer's).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.step.interrupt import StepInterrupt


def block_table_array(block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    nb = max(len(b) for b in block_ids)
    table = np.zeros((len(block_ids), nb), dtype=np.int64)
    for i, b in enumerate(block_ids):
        table[i, :len(b)] = b
    return table


def group_block_tables(block_ids: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """[G, B, nb] from each request's block ids per KV group (a request has as many in every group)."""
    return np.stack([block_table_array([groups[g] for groups in block_ids]) for g in range(len(block_ids[0]))])


def flat_batch(input_ids: np.ndarray, qlens: np.ndarray, starts: np.ndarray, block_table: np.ndarray,
               block_size: int, device: torch.device, layer_group: Sequence[int] = (), adapters: bool = False,
               rope_positions: Optional[np.ndarray] = None, interrupt: Optional[StepInterrupt] = None):
    """input_ids [T] (already packed); qlens/starts [B]; block_table [B, nb], or [G, B, nb] for G KV groups
    with layer_group (model layer index -> group); adapters: some token runs a LoRA adapter; rope_positions: the
    positions the rope reads when they are not the KV positions (M-RoPE's [3, T]: worker/multimodal.py);
    interrupt: the step's, checked between layers (step/interrupt.py). Returns
    (input_ids tensor, AttentionMetadata (group 0's),
    query_start_loc as numpy [B+1])."""
    B = len(qlens)
    qsl = np.zeros(B + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    T = int(qsl[-1])
    seq_lens = starts + qlens
    req_of_tok = np.repeat(np.arange(B), qlens)
    positions = starts[req_of_tok] + (np.arange(T) - qsl[req_of_tok])
    tables = block_table if block_table.ndim == 3 else block_table[None]
    slots = tables[:, req_of_tok, positions // block_size] * block_size + positions % block_size  # [G, T]
    to = lambda a: torch.from_numpy(a).to(device, non_blocking=True)  # noqa: E731
    grouped = len(tables) > 1
    metas: list[AttentionMetadata] = []  # filled below: every group's metadata holds this one list
    rope = positions if rope_positions is None else np.ascontiguousarray(rope_positions)
    common = dict(positions=to(rope), query_start_loc=qsl.tolist(), seq_lens=seq_lens.tolist(),
                  block_size=block_size, cache={}, layer_group=tuple(layer_group) if grouped else (),
                  group_metas=metas if grouped else [], adapters=adapters, interrupt=interrupt)
    metas.extend(AttentionMetadata(slot_mapping=to(slots[g]), block_table=to(tables[g]), kv_group=g, **common)
                 for g in range(len(tables)))
    return to(np.ascontiguousarray(input_ids, dtype=np.int64)), metas[0], qsl
