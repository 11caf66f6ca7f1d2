"""Scheduler half of KV offloading: which blocks live in the host-RAM and disk tiers, and what moves when.

Blocks enter the host tier when the device pool evicts them, and move on to disk when the host tier evicts
them (both LRU by block hash). A hit copies host slots into fresh device blocks at the start of the step that
admits the request. Disk is only ever read back into host slots, in the background: the request waits
(others run) and is looked up again once its reads are done; a read that fails its checksum just ends the
hit there, and the rest is recomputed.

A host slot is pinned while something refers to it: this step's plan (a save into it, a load from it) or a
request waiting for its reads (the slots it found and the ones being filled). Pinned slots are never evicted,
so a plan never overwrites a slot it also reads, and a finished read is still there when its request returns.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional

from tokenmill.engine.request import Request
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler
from tokenmill.kv_transfer.offload_plan import DELETE, READ, WRITE, OffloadOutput, OffloadPlan


class OffloadingScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, num_host_blocks: int, num_disk_blocks: int) -> None:
        self.block_size = block_size
        self.free_slots = list(range(num_host_blocks - 1, -1, -1))
        self.host: OrderedDict[bytes, int] = OrderedDict()    # resident: hash -> slot, least recent first
        self.reading: dict[bytes, int] = {}                   # disk -> host reads in flight: hash -> slot
        self.disk: OrderedDict[bytes, None] = OrderedDict()   # hashes with a file, least recent first
        self.num_disk_blocks = num_disk_blocks
        self.pins: Counter[int] = Counter()
        self.holds: dict[str, list[int]] = {}      # request id -> slots it pins
        self.hits: dict[str, list[int]] = {}       # request id -> host slots its last lookup supplies
        self.waits: dict[str, list[bytes]] = {}    # request id -> reads it waits for
        # saved/spilled/dropped_blocks: device -> host, host -> disk, lost for want of a free slot;
        # host_hit_blocks: host -> device loads; disk_hit/failed_blocks: disk -> host reads that passed/failed.
        self.stats: Counter[str] = Counter()
        self._plan = OffloadPlan()
        self._plan_pins: list[int] = []

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, req: Request, num_device_tokens: int) -> ExternalHit:
        self.release(req)
        rid, bs = req.request_id, self.block_size
        hashes = req.block_hashes[num_device_tokens // bs:(req.num_tokens - 1) // bs]
        held = self.holds[rid] = []
        found: list[int] = []
        for h in hashes:
            slot = self.host.get(h)
            if slot is None:
                break
            self.host.move_to_end(h)
            self._pin(slot, held)
            found.append(slot)
        waits = []
        for h in hashes[len(found):]:  # continue the run on disk: fetch into host slots, then come back
            slot = self.reading.get(h)
            if slot is None:
                if h not in self.disk:
                    break
                self.disk.move_to_end(h)  # first: the spill that frees a slot must not push h off the disk
                if (slot := self._take_slot()) is None:
                    break
                self.reading[h] = slot
                self._plan.disk_ops.append((READ, h, slot))
            self._pin(slot, held)
            waits.append(h)
        if waits:
            self.waits[rid] = waits
            return ExternalHit(0, ready=False)
        self.hits[rid] = found
        return ExternalHit(len(found) * bs, ready=True)

    def is_ready(self, req: Request) -> bool:
        return not any(h in self.reading for h in self.waits.get(req.request_id, ()))

    def on_allocated(self, req: Request, block_ids: list[int]) -> None:
        slots = self.hits.get(req.request_id, [])
        if len(slots) != len(block_ids):  # those blocks count as computed: each must be loaded
            raise RuntimeError(f"{req.request_id}: {len(block_ids)} device blocks for a hit of {len(slots)}")
        for slot, block_id in zip(slots, block_ids):
            self._plan.loads.append((slot, block_id))
            self._pin(slot, self._plan_pins)
        self.stats["host_hit_blocks"] += len(slots)
        self.release(req)

    def release(self, req: Request) -> None:
        rid = req.request_id
        self._unpin(self.holds.pop(rid, ()))
        self.hits.pop(rid, None)
        self.waits.pop(rid, None)

    # -- device evictions ---------------------------------------------------------------------
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self.host:
            self.host.move_to_end(block_hash)
            return
        if block_hash in self.reading:
            return
        slot = self._take_slot()
        if slot is None:  # every slot is in use this step: the block is simply dropped
            self.stats["dropped_blocks"] += 1
            return
        self.host[block_hash] = slot
        self._plan.saves.append((block_id, slot))
        self._pin(slot, self._plan_pins)
        self.stats["saved_blocks"] += 1

    def _take_slot(self) -> Optional[int]:
        if self.free_slots:
            return self.free_slots.pop()
        for _ in range(len(self.host)):  # least recently used unpinned slot; pinned ones count as in use
            h, slot = next(iter(self.host.items()))
            if not self.pins[slot]:
                del self.host[h]
                self._spill(h, slot)
                return slot
            self.host.move_to_end(h)
        return None

    def _spill(self, block_hash: bytes, slot: int) -> None:
        if not self.num_disk_blocks:
            return
        if block_hash in self.disk:  # blocks are immutable by hash: the file is still good
            self.disk.move_to_end(block_hash)
            return
        if len(self.disk) >= self.num_disk_blocks:
            old, _ = self.disk.popitem(last=False)
            self._plan.disk_ops.append((DELETE, old, -1))
        self.disk[block_hash] = None
        self._plan.disk_ops.append((WRITE, block_hash, slot))
        self.stats["spilled_blocks"] += 1

    def _pin(self, slot: int, holder: list[int]) -> None:
        self.pins[slot] += 1
        holder.append(slot)

    def _unpin(self, slots) -> None:
        for slot in slots:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                del self.pins[slot]

    # -- per step -----------------------------------------------------------------------------
    def build_plan(self) -> Optional[OffloadPlan]:
        plan, self._plan = self._plan, OffloadPlan()
        self._unpin(self._plan_pins)  # the worker runs this plan before the next one is built
        self._plan_pins = []
        return plan if (plan or self.reading) else None  # reads in flight: let the worker report them

    def update(self, output: Optional[OffloadOutput]) -> None:
        if output is None:
            return
        for h, ok in output.finished_reads:
            slot = self.reading.pop(h)
            if ok:
                self.host[h] = slot
                self.stats["disk_hit_blocks"] += 1
            else:  # corrupt or missing: forget the file (the worker removed it); the block is recomputed
                self.free_slots.append(slot)
                self.disk.pop(h, None)
                self.stats["failed_blocks"] += 1

    def counters(self) -> dict[str, int]:
        return dict(self.stats, host_blocks=len(self.host), disk_blocks=len(self.disk))

    def idle(self) -> bool:
        """Nothing held for any request and nothing in flight (tests: nothing leaks)."""
        return not (self.holds or self.pins or self.reading or self.waits or self.hits)
