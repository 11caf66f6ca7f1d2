"""KV groups: which layers share a block table (docs/architecture.md §4.3; vLLM's hybrid KV cache, simply).

A sliding-window layer never reads a position more than window - 1 behind its query, so its blocks before that
can go back to the pool while a full-attention layer of the same request still needs its own. Layers are
grouped by kind (full attention, or one window length): a request has one block table per group, and the KV
manager (engine/kv_cache_manager.py) frees a sliding group's blocks as they leave the window.

Layout (perf.memory.kv_groups, which tokenmill plan counts with too): every group has the same number of layer
slots S, the layer count of the smallest kind (Gemma 3: its full layers); a kind of n layers is split into
ceil(n / S) groups, the last padded. The worker allocates one KV
tensor per slot, [2, kv_heads, num_blocks, block_size, head_dim], shared by the i-th layer of every group, and
a block id belongs to one group of one request at a time (one shared pool): a block is S layers' KV for
block_size positions. A model with one kind of layer (all full, or Mistral's window on every layer) has one
group of all its layers, which is the layout without groups.

Where a part of the engine cannot work with groups yet, every layer goes into one group that keeps every
block (`one_group_reason` says why; the windows then only mask): KV connectors copy whole blocks of every
layer by id, and a KV-keeping drafter writes its own layers' KV under the target's block ids.

Invariant: the scheduler and every worker compute the same layout from the same EngineConfig (`kv_layout`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tokenmill.config import EngineConfig, layer_windows
from tokenmill.perf.memory import kv_groups


@dataclass(frozen=True)
class KVGroup:
    window: Optional[int]    # its layers' sliding window: blocks before it are freed; None: keeps every block
    layers: tuple[int, ...]  # model layer indices; layers[i] uses layer slot i


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]
    num_slots: int                    # KV tensors (layer slots) the worker allocates per block id
    layer_group: tuple[int, ...]      # model layer index -> its group
    layer_slot: tuple[int, ...]       # model layer index -> its slot
    one_group_reason: Optional[str] = None  # why sliding layers keep every block, or None

    @property
    def windows(self) -> tuple[Optional[int], ...]:
        return tuple(g.window for g in self.groups)

    @property
    def frees_blocks(self) -> bool:
        """Some group frees blocks that left its window (the KV manager then reserves a null block)."""
        return any(w is not None for w in self.windows)

    def usable_blocks(self, num_blocks: int) -> int:
        """Blocks requests can get out of num_blocks: all but the null block, which a sliding group needs."""
        return num_blocks - self.frees_blocks

    def max_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of num_tokens tokens holds at once when it runs in steps of at most
        max_chunk tokens: a full group every block; a sliding group those a step reads or writes (window - 1
        positions before the step's tokens, and its tokens), which may start inside a block."""
        full = -(-num_tokens // block_size)
        return sum(full if w is None else min(full, -(-(w - 1 + max_chunk) // block_size) + 1) for w in self.windows)

    def describe(self) -> str:
        """One line for the startup log and the kernels report."""
        if len(self.groups) == 1:
            g = self.groups[0]
            kind = "full attention" if g.window is None else f"window {g.window}, freed as it slides"
            text = f"1 group of {len(g.layers)} layers ({kind})"
            if self.one_group_reason:
                text += f"; sliding windows only mask: {self.one_group_reason}"
            return text
        kinds = ", ".join(f"{'full' if g.window is None else f'window {g.window}'} {list(g.layers)}"
                          for g in self.groups)
        slots = f"{self.num_slots} layer slot{'s' if self.num_slots > 1 else ''}"
        return f"{len(self.groups)} groups of {slots}: {kinds}"


def group_layers(windows: Sequence[Optional[int]], one_group_reason: Optional[str] = None) -> KVLayout:
    """The layout for these per-layer windows (None: full attention; the grouping rule is perf.memory.kv_groups,
    which tokenmill plan counts with). With one_group_reason, one group of every layer that keeps every block."""
    if one_group_reason is not None:
        return _layout([KVGroup(None, tuple(range(len(windows))))], len(windows), one_group_reason)
    slots, groups = kv_groups(windows)
    return _layout([KVGroup(w, layers) for w, layers in groups], slots)


def _layout(groups: list[KVGroup], num_slots: int, one_group_reason: Optional[str] = None) -> KVLayout:
    num_layers = sum(len(g.layers) for g in groups)
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for gi, g in enumerate(groups):
        for slot, layer in enumerate(g.layers):
            group_of[layer], slot_of[layer] = gi, slot
    return KVLayout(tuple(groups), num_slots, tuple(group_of), tuple(slot_of), one_group_reason)


def model_windows(config: EngineConfig) -> list[Optional[int]]:
    """Each layer's window, None where it is full attention or no request can outgrow the window
    (max_model_len <= window: nothing would ever be freed)."""
    mc = config.model
    return [w if w and w < mc.max_model_len else None for w in layer_windows(mc.hf_config)]


def why_one_group(config: EngineConfig) -> Optional[str]:
    """Why this engine keeps every layer in one group, or None."""
    if config.cache.disable_hybrid_kv_cache_manager:
        return "--disable-hybrid-kv-cache-manager"
    if config.cache.kv_offloading_bytes:
        return "KV tiers (--kv-offloading-size) copy whole blocks of every layer"
    if config.kv_transfer is not None:
        return "disaggregated prefill/decode (--kv-transfer-config) sends whole blocks of every layer"
    if config.speculative is not None and config.speculative.needs_kv:
        return f"the {config.speculative.method} drafter keeps its KV under the target's block ids"
    return None


def kv_layout(config: EngineConfig) -> KVLayout:
    """The engine's layout (the scheduler's and every worker's: computed from the config alone)."""
    windows = model_windows(config)
    reason = why_one_group(config) if any(w is not None for w in windows) else None
    return group_layers(windows, reason)
