"""Worker half of KV offloading: executes the scheduler's plans against the host pool and the disk store."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import KVConnectorWorker
from tokenmill.kv_transfer.disk_store import DiskBlockStore
from tokenmill.kv_transfer.fingerprint import kv_fingerprint
from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.step.offload_plan import READ, WRITE, WRITE_FROM_DEVICE, OffloadOutput, OffloadPlan


class OffloadingWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, num_host_blocks: int) -> None:
        self.config = config
        self.num_host_blocks = num_host_blocks
        self.disk_dir = config.cache.kv_offloading_disk_dir
        self.host: Optional[HostBlockPool] = None
        self.disk: Optional[DiskBlockStore] = None

    def register_kv_caches(self, kv_caches: list[torch.Tensor], kv_quants: Sequence = ()) -> None:
        # Scales need not travel: the tiers' blocks only ever come back to this instance, whose scales they are.
        self.host = HostBlockPool(kv_caches, self.num_host_blocks)
        if self.disk_dir is not None:
            self.disk = DiskBlockStore(self.disk_dir, self.host.rows_np, kv_fingerprint(self.config, kv_caches))

    def start_step(self, plan: OffloadPlan) -> None:
        from_device = [arg for kind, _, arg in plan.disk_ops if kind == WRITE_FROM_DEVICE]
        device_rows = iter(self.host.copy_out(from_device)) if from_device else None
        for kind, block_hash, arg in plan.disk_ops:
            if kind == WRITE:  # snapshot now: the slot may be refilled by this very plan
                self.disk.write(block_hash, self.host.row(arg).copy())
            elif kind == WRITE_FROM_DEVICE:  # snapshotted above, before loads or the forward pass reuse it
                self.disk.write(block_hash, next(device_rows))
            elif kind == READ:
                self.disk.read(block_hash, arg)
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
