"""Worker half of KV offloading: executes the scheduler's plans against the host pool and the disk store."""
from __future__ import annotations

from typing import Optional

import torch

from tokenmill.kv_transfer.base import KVConnectorWorker
from tokenmill.kv_transfer.disk_store import DiskBlockStore
from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.kv_transfer.offload_plan import READ, WRITE, OffloadOutput, OffloadPlan


class OffloadingWorker(KVConnectorWorker):
    def __init__(self, num_host_blocks: int, disk_dir: Optional[str]) -> None:
        self.num_host_blocks = num_host_blocks
        self.disk_dir = disk_dir
        self.host: Optional[HostBlockPool] = None
        self.disk: Optional[DiskBlockStore] = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.host = HostBlockPool(kv_caches, self.num_host_blocks)
        if self.disk_dir is not None:
            self.disk = DiskBlockStore(self.disk_dir, self.host.rows_np)

    def start_step(self, plan: OffloadPlan) -> None:
        for kind, block_hash, slot in plan.disk_ops:
            if kind == WRITE:  # snapshot now: the slot may be refilled by this very plan
                self.disk.write(block_hash, self.host.row(slot).copy())
            elif kind == READ:
                self.disk.read(block_hash, slot)
            else:
                self.disk.delete(block_hash)
        if plan.saves:
            self.host.save(*map(list, zip(*plan.saves)))
        if plan.loads:
            self.host.load(*map(list, zip(*plan.loads)))

    def finished(self, wait: bool = False) -> Optional[OffloadOutput]:
        if self.disk is None:
            return None
        done = self.disk.finished_reads(wait)
        return OffloadOutput(done) if done else None

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
