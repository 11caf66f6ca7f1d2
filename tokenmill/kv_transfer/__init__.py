"""KV transfer: connectors that move KV blocks between a worker's device cache and somewhere else.

base.py holds the two-sided interface; the offloading connector (host-RAM tier, disk tier below it) is the
first implementation: offload_scheduler.py decides (its eviction order from block_chains.py),
offload_worker.py executes with host_pool.py and disk_store.py (files stamped by fingerprint.py).
"""
from __future__ import annotations

from typing import Optional

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler, KVConnectorWorker  # noqa: F401
from tokenmill.kv_transfer.offload_plan import tier_capacity


def _capacity(config: EngineConfig, bytes_per_block: int) -> tuple[int, int]:
    cc = config.cache
    return tier_capacity(cc.kv_offloading_bytes, cc.kv_offloading_disk_bytes, bytes_per_block)


def make_scheduler_connector(config: EngineConfig, bytes_per_block: int) -> Optional[KVConnectorScheduler]:
    if not config.cache.kv_offloading_bytes:
        return None
    from tokenmill.kv_transfer.offload_scheduler import OffloadingScheduler

    return OffloadingScheduler(config.cache.block_size, *_capacity(config, bytes_per_block))


def make_worker_connector(config: EngineConfig, bytes_per_block: int) -> Optional[KVConnectorWorker]:
    if not config.cache.kv_offloading_bytes:
        return None
    from tokenmill.kv_transfer.offload_worker import OffloadingWorker

    num_host_blocks, _ = _capacity(config, bytes_per_block)
    return OffloadingWorker(config, num_host_blocks)
