"""The attention backend interface: attention over one flat batch and the paged KV cache.

KV cache layout per layer: [2, num_kv_heads, num_blocks, block_size, head_dim] (k at 0, v at 1). Heads
outermost, so gathering a batch's blocks yields [heads, batch, context, head_dim] with no transpose copy.
The token at position p of a request lives in slot block_ids[p // block_size] * block_size + p % block_size.
With KV groups (step/kv_groups.py) each group has its own block table and slots, and its layers share the
cache tensors of the group's layer slots: a layer reads its group's through `meta.for_layer(layer_idx)`.
Every backend first writes the step's new k/v into their slots for all requests, then attends: a request
may read blocks another request of the same step is writing (shared prefix), which is why writes come first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from tokenmill.step.interrupt import StepInterrupt


@dataclass
class AttentionMetadata:
    positions: torch.Tensor          # [T] rope positions ([3, T] for M-RoPE); attention itself never reads them
    slot_mapping: torch.Tensor       # [T] (of KV group kv_group)
    block_table: torch.Tensor        # [B, max_blocks] (padded with 0; of KV group kv_group)
    query_start_loc: list[int]       # [B+1]
    seq_lens: list[int]              # [B] context length after this step
    block_size: int
    # per-step derived tensors, built once, shared by every layer (the metadata of every KV group share it)
    cache: dict[Any, Any] = field(default_factory=dict)
    kv_group: int = 0
    layer_group: Sequence[int] = ()  # model layer index -> its KV group; empty: one group (this metadata)
    group_metas: list["AttentionMetadata"] = field(default_factory=list)  # [g]: group g's (one list, shared)
    adapters: bool = False  # some token runs a LoRA adapter (layers/lora.py): paths without adapters step aside
    interrupt: Optional[StepInterrupt] = None  # checked between layers: the step may be cut short (step/interrupt.py)

    def for_layer(self, layer_idx: int) -> "AttentionMetadata":
        """The metadata holding this layer's KV group's block table and slots (self with one group)."""
        return self.group_metas[self.layer_group[layer_idx]] if self.layer_group else self

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    def query_len(self, i: int) -> int:
        return self.query_start_loc[i + 1] - self.query_start_loc[i]


def paged_kv_shape(num_kv_heads: int, num_blocks: int, block_size: int, head_dim: int) -> tuple[int, ...]:
    """One layer slot's KV tensor in the layout above (an attention layer's kv_cache_shape; latent attention
    declares its own, layers/attention/mla.py)."""
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


class AttentionBackend:
    name = "base"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: Optional[int], kv_quant=None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. kv_quant (a kv_quant.KVCacheQuant) when the cache
        holds fp8/int8. sinks: the layer's learned attention sinks (gpt-oss), one logit per query head [Hq] that
        joins every softmax's denominator and weights no value; None for models without them."""
        raise NotImplementedError
