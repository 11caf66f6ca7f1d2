"""KV transfer: connectors that move KV blocks between a worker's device cache and somewhere else.

base.py holds the two-sided interface. Two implementations, which an engine may run at once (composite.py
forwards each call to both; step.py's ConnectorPlan/ConnectorOutput carry their plans and outputs):

- KV offloading (--kv-offloading-size): a host-RAM tier with a disk tier below it. offload_scheduler.py
  decides (its eviction order from block_chains.py), offload_worker.py executes with host_pool.py and
  disk_store.py (files stamped by fingerprint.py).
- Disaggregated prefill/decode (--kv-transfer-config): a prefill instance holds a finished prompt's blocks
  until a decode instance has pulled them over the network. p2p_scheduler.py decides, p2p_worker.py serves
  and pulls through a transport (p2p_transport.py: the interface, and TCP), p2p_plan.py is what they say.
"""
from __future__ import annotations

from typing import Optional

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler, KVConnectorWorker  # noqa: F401
from tokenmill.step.offload_plan import tier_capacity


def _capacity(config: EngineConfig, bytes_per_block: int) -> tuple[int, int]:
    cc = config.cache
    return tier_capacity(cc.kv_offloading_bytes, cc.kv_offloading_disk_bytes, bytes_per_block)


def make_scheduler_connector(config: EngineConfig, bytes_per_block: int) -> Optional[KVConnectorScheduler]:
    """The engine's connector (the configured ones composed), or None when none is configured."""
    offload = transfer = None
    if config.cache.kv_offloading_bytes:
        # ~8 ms with messages: `serve --help`, the router and the API process import this package (p2p_params)
        from tokenmill.kv_transfer.offload_scheduler import OffloadingScheduler

        offload = OffloadingScheduler(config.cache.block_size, *_capacity(config, bytes_per_block))
    if config.kv_transfer is not None:
        from tokenmill.kv_transfer.p2p_scheduler import TransferScheduler  # as above

        transfer = TransferScheduler(config.kv_transfer, config.cache.block_size,
                                     config.model.hf_config.vocab_size)
    if offload is None and transfer is None:
        return None
    from tokenmill.kv_transfer.composite import CompositeScheduler  # imports torch: the API process must not

    return CompositeScheduler(offload, transfer)


def make_worker_connector(config: EngineConfig, bytes_per_block: int) -> Optional[KVConnectorWorker]:
    offload = transfer = None
    if config.cache.kv_offloading_bytes:
        from tokenmill.kv_transfer.offload_worker import OffloadingWorker  # imports torch, as above

        num_host_blocks, _ = _capacity(config, bytes_per_block)
        offload = OffloadingWorker(config, num_host_blocks)
    if config.kv_transfer is not None:
        from tokenmill.kv_transfer.p2p_worker import TransferWorker  # imports torch, as above

        transfer = TransferWorker(config)
    if offload is None and transfer is None:
        return None
    from tokenmill.kv_transfer.composite import CompositeWorker  # imports torch, as above

    return CompositeWorker(offload, transfer)
