"""What the two halves of the offloading connector tell each other (plain data: it may cross processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

WRITE, WRITE_FROM_DEVICE, READ, DELETE = "write", "write_from_device", "read", "delete"


@dataclass
class OffloadPlan:
    """One step's transfers, executed by the worker in this order:

    1. disk_ops, in the order the scheduler decided them, handed to the disk tier's I/O thread (which keeps
       that order): (WRITE, hash, slot) copies a host slot the tier is evicting to a file (its bytes are
       snapshotted now, before step 2 may refill the slot), (WRITE_FROM_DEVICE, hash, device block) copies
       a block the device pool hands out again this step that found no host slot straight to a file (also
       snapshotted now), (READ, hash, slot) fills a reserved slot from a file in the background (reported
       later), (DELETE, hash, -1) removes a file the disk tier evicted.
    2. saves: (device block, host slot), blocks the device pool hands out again this step.
    3. loads: (host slot, device block), blocks a request admitted this step counts as computed.
    """
    disk_ops: list[tuple[str, bytes, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.disk_ops or self.saves or self.loads)


@dataclass
class OffloadOutput:
    finished_reads: list[tuple[bytes, bool]]  # (block hash, the file was intact and is now in its host slot)


def tier_capacity(host_bytes: int, disk_bytes: int, bytes_per_block: int) -> tuple[int, int]:
    """Blocks the host and disk tiers hold; both halves compute it from the same config."""
    host = host_bytes // bytes_per_block
    if host_bytes and host < 1:
        raise ValueError(f"kv_offloading_size of {host_bytes / 2**30:.4g} GiB holds no KV block "
                         f"({bytes_per_block} bytes each); raise --kv-offloading-size")
    return host, disk_bytes // bytes_per_block
