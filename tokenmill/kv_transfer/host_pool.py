"""Host-RAM tier storage: a preallocated pool of KV block slots and the batched copies to and from the device.

A slot is one contiguous row of bytes holding a block of every registered KV tensor (each layer's K and V,
then a KV-keeping drafter's), which is also exactly what a disk file holds. Blocks move as raw bytes, so every
KV dtype round-trips exactly (fp8/int8 scales are per layer, not per block: they stay on the worker; a transfer
to another instance sends them beside the rows, p2p_worker.py).
"""
from __future__ import annotations

import numpy as np
import torch


class HostBlockPool:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        self.device = kv_caches[0].device
        self.device_views = [kv.view(torch.uint8) for kv in kv_caches]   # [2, heads, blocks, block_size, bytes]
        self.block_shapes = [(v.shape[0], v.shape[1], v.shape[3], v.shape[4]) for v in self.device_views]
        self.block_nbytes = sum(int(np.prod(s)) for s in self.block_shapes)
        # Pinned on CUDA so copies run at full PCIe speed; on CPU a large empty tensor costs nothing until used.
        self.rows = torch.empty((num_slots, self.block_nbytes), dtype=torch.uint8,
                                pin_memory=self.device.type == "cuda")
        self.rows_np = self.rows.numpy()
        self.host_views = self.per_kv_tensor(self.rows)

    def per_kv_tensor(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Views of rows ([n, block bytes]) per KV tensor: [n, 2, heads, block_size, bytes], a column range each."""
        views, offset = [], 0
        for shape in self.block_shapes:
            size = int(np.prod(shape))
            views.append(rows[:, offset:offset + size].unflatten(1, shape))
            offset += size
        return views

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        """Device blocks -> host slots, one gather per KV tensor for the whole batch."""
        self._gather(block_ids, torch.tensor(slots), self.host_views)

    def copy_out(self, block_ids: list[int]) -> np.ndarray:
        """Device blocks -> new host rows ([n, block bytes]) that belong to the caller (a disk write)."""
        rows = torch.empty((len(block_ids), self.block_nbytes), dtype=torch.uint8)
        self._gather(block_ids, torch.arange(len(block_ids)), self.per_kv_tensor(rows))
        return rows.numpy()

    def _gather(self, block_ids: list[int], idx: torch.Tensor, host_views: list[torch.Tensor]) -> None:
        ids = torch.tensor(block_ids, device=self.device)
        for dev, host in zip(self.device_views, host_views):
            host[idx] = dev.index_select(2, ids).movedim(2, 0).cpu()

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        """Host slots -> device blocks."""
        ids = torch.tensor(block_ids, device=self.device)
        idx = torch.tensor(slots)
        for dev, host in zip(self.device_views, self.host_views):
            dev.index_copy_(2, ids, host[idx].movedim(0, 2).to(self.device))

    def load_rows(self, rows: torch.Tensor, block_ids: list[int]) -> None:
        """Rows the caller owns ([n, block bytes], e.g. received from another instance) -> device blocks."""
        ids = torch.tensor(block_ids, device=self.device)
        for dev, host in zip(self.device_views, self.per_kv_tensor(rows)):
            dev.index_copy_(2, ids, host.movedim(0, 2).to(self.device))

    def row(self, slot: int) -> np.ndarray:
        return self.rows_np[slot]
