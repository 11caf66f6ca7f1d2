"""Scheduler half of KV offloading: which blocks live in the host-RAM and disk tiers, and what moves when.

Blocks enter the host tier when the device pool evicts them, and move on to disk when the host tier evicts
them (disk: LRU by block hash). A lookup stops at the first miss, so a chain is only useful from its head:
the host tier evicts the least recently used block none of whose children it holds (block_chains.py), and
every touch of a chain goes tail first (the device evicts a request's blocks tail first; a lookup touches
the run it found from its end), so chains leave from their tails. When a step evicts more device blocks than
the host tier has free slots for, the blocks of that step give way in turn (a leaf first, then the one
farthest from its chain's start) and go straight from the device to disk; without a disk tier they are
dropped.

A hit copies host slots into fresh device blocks at the start of the step that admits the request. Disk is
only ever read back into host slots, in the background (so one hit is at most the host tier's size): the
request waits (others run) and is looked up again once its reads are done; a read that fails its checksum
just ends the hit there, and the rest is recomputed.

A host slot is pinned while something refers to it: this step's plan (a save into it, a load from it) or a
request waiting for its reads (the slots it found and the ones being filled). Pinned slots are never evicted,
so a plan never overwrites a slot it also reads, and a finished read is still there when its request returns.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional

from tokenmill.messages import Request
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler
from tokenmill.kv_transfer.block_chains import BlockChains
from tokenmill.step.offload_plan import DELETE, READ, WRITE, WRITE_FROM_DEVICE, OffloadOutput, OffloadPlan


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
        # saved/spilled/dropped_blocks: device -> host, host or device -> disk, evicted from the device and lost
        # for want of a host slot and a disk tier;
        # host_hit_blocks: host -> device loads; disk_hit/failed_blocks: disk -> host reads that passed/failed.
        self.stats: Counter[str] = Counter()
        self._plan = OffloadPlan()
        self._plan_pins: list[int] = []
        self._planned_save_hashes: list[bytes] = []  # the hash of each of self._plan.saves
        self.chains = BlockChains(num_host_blocks)

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, req: Request, num_device_tokens: int) -> ExternalHit:
        self.release(req)
        rid, bs = req.request_id, self.block_size
        hashes = req.block_hashes[num_device_tokens // bs:(req.num_tokens - 1) // bs]
        self._touch_tail_first(hashes)
        held = self.holds[rid] = []
        found: list[int] = []
        for h in hashes:
            slot = self.host.get(h)
            if slot is None:
                break
            self._pin(slot, held)
            found.append(slot)
        waits = []
        for h in hashes[len(found):]:  # continue the run on disk: fetch into host slots, then come back
            slot = self.reading.get(h)
            if slot is None:
                if h not in self.disk or (slot := self._take_slot()) is None:
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

    def _touch_tail_first(self, hashes: list[bytes]) -> None:
        """Make the leading run of hashes the tiers hold most recent, its head last (the most recent of all).
        Before any slot is taken for a read, so the spill that frees it cannot push the run off the disk."""
        run = 0
        while run < len(hashes) and (hashes[run] in self.host or hashes[run] in self.reading
                                     or hashes[run] in self.disk):
            run += 1
        for h in reversed(hashes[:run]):
            if h in self.host:
                self.host.move_to_end(h)
            if h in self.disk:
                self.disk.move_to_end(h)

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
        # Every request passes here with its chain so far: at lookup (which starts by releasing), admission
        # and finish.
        self.chains.learn(req.block_hashes)
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
        if slot is not None:
            self._pin(slot, self._plan_pins)
        elif (slot := self._take_planned_save(block_hash)) is None:
            self._spill_or_drop(block_hash, WRITE_FROM_DEVICE, block_id)
            return
        self._host_put(block_hash, slot)
        self._plan.saves.append((block_id, slot))
        self._planned_save_hashes.append(block_hash)
        self.stats["saved_blocks"] += 1

    def _take_slot(self) -> Optional[int]:
        if self.free_slots:
            return self.free_slots.pop()
        block_hash = self._host_victim()
        if block_hash is None:  # pinned slots count as in use
            return None
        slot = self._host_remove(block_hash)
        self._spill(block_hash, WRITE, slot)
        return slot

    def _host_victim(self) -> Optional[bytes]:
        """The least recently used unpinned leaf (no child in the host tier), else the least recently used
        unpinned block."""
        fallback = None
        for h, slot in self.host.items():
            if self.pins[slot]:
                continue
            if self.chains.is_leaf(h):
                return h
            fallback = fallback or h
        return fallback

    def _host_put(self, block_hash: bytes, slot: int) -> None:
        self.host[block_hash] = slot
        self.chains.entered_host(block_hash)

    def _host_remove(self, block_hash: bytes) -> int:
        self.chains.left_host(block_hash)
        return self.host.pop(block_hash)

    def _take_planned_save(self, arriving: bytes) -> Optional[int]:
        """Every slot is in use this step: the slot of one of its saves that nothing else refers to (it stays
        pinned by the plan) if that block ranks before the arriving one for eviction (saves of one step are
        equally recent: a leaf first, then the one farthest from its chain's start, then the oldest). That
        block goes straight from the device to disk. None: the arriving block gives way."""
        free = [i for i, (_, slot) in enumerate(self._plan.saves) if self.pins[slot] == 1]  # no lookup found it
        candidates = [self._planned_save_hashes[i] for i in free] + [arriving]
        pick = max(range(len(candidates)), key=lambda j: self.chains.eviction_rank(candidates[j]))  # first max
        if pick == len(free):
            return None
        block_id, slot = self._plan.saves.pop(free[pick])
        block_hash = self._planned_save_hashes.pop(free[pick])
        self._host_remove(block_hash)
        self.stats["saved_blocks"] -= 1
        self._spill_or_drop(block_hash, WRITE_FROM_DEVICE, block_id)
        return slot

    def _spill_or_drop(self, block_hash: bytes, kind: str, source: int) -> None:
        if not self._spill(block_hash, kind, source):
            self.stats["dropped_blocks"] += 1

    def _spill(self, block_hash: bytes, kind: str, source: int) -> bool:
        """Give a block to the disk tier: (WRITE, host slot) or (WRITE_FROM_DEVICE, device block). False: no
        disk tier."""
        if not self.num_disk_blocks:
            return False
        if block_hash in self.disk:  # blocks are immutable by hash: the file is still good
            self.disk.move_to_end(block_hash)
            return True
        if len(self.disk) >= self.num_disk_blocks:
            old, _ = self.disk.popitem(last=False)
            self._plan.disk_ops.append((DELETE, old, -1))
        self.disk[block_hash] = None
        self._plan.disk_ops.append((kind, block_hash, source))
        self.stats["spilled_blocks"] += 1
        return True

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
        self._planned_save_hashes = []
        return plan if (plan or self.reading) else None  # reads in flight: let the worker report them

    def update(self, output: Optional[OffloadOutput]) -> None:
        if output is None:
            return
        for h, ok in output.finished_reads:
            slot = self.reading.pop(h)
            if ok:
                self._host_put(h, slot)
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
