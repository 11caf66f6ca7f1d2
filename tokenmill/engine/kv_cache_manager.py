"""Paged KV block accounting: one block pool with ref counts, a block list per KV group of each request, a
hash-chain prefix cache per group, and an LRU of free blocks.

KV groups (step/kv_groups.py): a request has one block list per group, all of the same length: index i holds
positions [i * block_size, (i + 1) * block_size) in every group. A full group (window None) holds a real block
at every index. A sliding group (window W) gives back each block that no query of this or a later step can
see, i.e. whose positions all lie before num_computed_tokens - W + 1 (the first position computed next, less
the window), and keeps the null block at its index (id 0, never handed out; reserved only when some group
slides). A model with one kind of layer has one group: the layout and behaviour of a cache without groups.

Invariants:
- A block with ref_cnt > 0 is owned by at least one running request, in one group, and is never in the free
  queue. The null block is owned by no one and never in the free queue.
- A block in the free queue may still hold valid cached KV (block_hash set); it is reused on a prefix hit of
  its own group, or evicted (hash dropped) from the front of the queue when a fresh block is needed. Blocks a
  sliding group gives back keep their hash, so a later prompt can still hit them.
- After each step (free_out_of_window), a sliding group of a running request owns no block that lies wholly
  before num_computed_tokens - W + 1. Giving a block back is not announced to the worker: its copy of the block
  table keeps the old id, and the pool may hand the block to another request, which writes it. That is safe
  because attention never reads a position of a sliding layer outside [query - W + 1, query] (the paged kernels'
  key range starts there; the gathered paths start at the window's first block or give the positions before
  it exactly zero weight, and any block holds finite values), and positions before the window are never
  written again: a step writes only its own new positions, which have real blocks.
- Every block a request owns returns to the pool when the request finishes, aborts or is preempted.
- Evicting a block's cached content is announced (on_evict) before the block is reused, so a KV connector
  can copy it to a lower tier first (tokenmill/kv_transfer; connectors run with one group).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Optional, Sequence

from tokenmill.messages import Request
from tokenmill.step.multimodal import image_cache_key

NULL_BLOCK_ID = 0  # a sliding group's entry for a block it gave back (reserved only when some group slides)


def hash_block(parent: Optional[bytes], token_ids: list[int], extra: Optional[str]) -> bytes:
    """Content address of a full block: (parent hash, its token ids, extra keys such as a salt).
    blake2b rather than Python's hash(): collision-safe and identical across processes (router, tiers)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra.encode())
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None
        self.group = 0  # the KV group whose prefix cache holds it (meaningful while block_hash is set)


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Optional[Callable[[int, bytes], None]] = None,
                 reserve_null: bool = False) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null: Optional[Block] = self.blocks[NULL_BLOCK_ID] if reserve_null else None
        self.free: OrderedDict[int, Block] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b is not self.null)  # LRU first
        # (group, hash) -> block: the same tokens in two groups are two blocks (each holds its own layers' KV)
        self.cached: dict[tuple[int, bytes], Block] = {}
        self.on_evict = on_evict  # (block id, hash): a KV connector may save the content first

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        """Blocks that can be handed out: all but the null block."""
        return len(self.blocks) - (self.null is not None)

    def allocate(self) -> Block:
        _, block = self.free.popitem(last=False)
        if block.block_hash is not None:  # evict its cached content
            if self.cached.get((block.group, block.block_hash)) is block:
                del self.cached[(block.group, block.block_hash)]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def touch(self, block: Block) -> None:
        if block.ref_cnt == 0:
            del self.free[block.block_id]
        block.ref_cnt += 1

    def release(self, block: Block) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            self.free[block.block_id] = block

    def lookup(self, group: int, block_hash: bytes) -> Optional[Block]:
        return self.cached.get((group, block_hash))

    def register(self, block: Block, block_hash: bytes, group: int) -> None:
        block.block_hash, block.group = block_hash, group
        self.cached.setdefault((group, block_hash), block)

    def unregister(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get((block.group, block.block_hash)) is block:
            del self.cached[(block.group, block.block_hash)]
        block.block_hash = None


class KVCacheManager:
    """windows: per KV group, its sliding window (None: the group keeps every block); default one full group."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_evict: Optional[Callable[[int, bytes], None]] = None,
                 windows: Sequence[Optional[int]] = (None,)) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.windows = tuple(windows)
        self.pool = BlockPool(num_blocks, on_evict, reserve_null=any(w is not None for w in self.windows))
        self.req_blocks: dict[str, list[list[Block]]] = {}  # request id -> per group, its blocks by position
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0
        self.num_external_queries = 0  # prompt tokens past the device hit asked of a KV connector (lower tiers)
        self.num_external_hits = 0

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_usable

    # -- prefix cache ---------------------------------------------------------------------
    def _extra_key(self, req: Request) -> Optional[str]:
        # Without prefix caching a request shares only with itself (after preemption) and with the
        # siblings of an n>1 request, to which the front gives one salt. An adapter's KV differs from the base
        # model's for the same tokens: its id keys its blocks apart (a reloaded adapter gets a new id).
        key = req.cache_salt if self.enable_caching else (req.cache_salt or f"\0{req.request_id}")
        return f"{key or ''}\0lora:{req.lora_int_id}" if req.lora_int_id else key

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        bs, hashes = self.block_size, req.block_hashes
        extra = self._extra_key(req)
        for i in range(len(hashes), num_tokens // bs):
            # a block holding image tokens is keyed by the images too (their placeholder ids are all alike)
            images = image_cache_key(req.mm_inputs, i * bs, (i + 1) * bs) if req.mm_inputs else ""
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs:(i + 1) * bs],
                                     f"{extra or ''}\0img:{images}" if images else extra))

    @staticmethod
    def reuses_cache(req: Request) -> bool:
        """A request reporting prompt logprobs needs logits for every prompt position: it computes them all."""
        return req.sampling_params.prompt_logprobs is None

    def _first_in_window(self, window: Optional[int], position: int) -> int:
        """Index of the first block a query at `position` or later can read through this window (0: all)."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def get_computed_blocks(self, req: Request) -> tuple[list[list[Block]], int]:
        """The longest run of cached full blocks at the start of the request that every group can serve, and per
        group the blocks it needs for it: a full group all of them; a sliding group those within its window
        before the hit's end, after the null block at each earlier index. At least one token is always left to
        compute (its logits start generation)."""
        if not self.reuses_cache(req):
            return [[] for _ in self.windows], 0
        self._update_hashes(req, req.num_tokens)
        hashes = req.block_hashes[:(req.num_tokens - 1) // self.block_size]
        n = len(hashes)
        for g, window in enumerate(self.windows):
            if window is None:
                n = self._cached_prefix(g, hashes, n)
        n = self._sliding_hit(hashes, n)
        return [self._hit_blocks(g, w, hashes, n) for g, w in enumerate(self.windows)], n * self.block_size

    def _cached_prefix(self, group: int, hashes: list[bytes], limit: int) -> int:
        for i in range(limit):
            if self.pool.lookup(group, hashes[i]) is None:
                return i
        return limit

    def _sliding_hit(self, hashes: list[bytes], limit: int) -> int:
        """The longest hit of at most `limit` blocks that every sliding group serves; one group lowering it may
        leave another without its window there, so the groups are asked again until none lowers it."""
        n, settled = limit, False
        while not settled:
            settled = True
            for g, window in enumerate(self.windows):
                if window is not None:
                    m = self._window_hit(g, window, hashes, n)
                    settled, n = settled and m == n, m
        return n

    def _window_hit(self, group: int, window: int, hashes: list[bytes], limit: int) -> int:
        """The longest hit of at most `limit` blocks whose window (the blocks a query right after it reads) is
        cached in this group, searched from the right: a missing block rules out every hit that reads it, so
        the next candidate ends just before it."""
        n = limit
        while n > 0:
            first = self._first_in_window(window, n * self.block_size)
            missing = next((i for i in range(n - 1, first - 1, -1) if self.pool.lookup(group, hashes[i]) is None),
                           None)
            if missing is None:
                return n
            n = missing
        return 0

    def _hit_blocks(self, group: int, window: Optional[int], hashes: list[bytes], n: int) -> list[Block]:
        first = self._first_in_window(window, n * self.block_size)
        return [self.pool.null] * first + [self.pool.lookup(group, hashes[i]) for i in range(first, n)]

    def record_lookup(self, num_tokens: int, num_hit_tokens: int, num_external_tokens: Optional[int] = None) -> None:
        """num_external_tokens: what a KV connector supplied after the device hit (None: no connector)."""
        if self.enable_caching:
            self.num_queries += num_tokens
            self.num_hits += num_hit_tokens
            if num_external_tokens is not None:
                self.num_external_queries += num_tokens - num_hit_tokens
                self.num_external_hits += num_external_tokens

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, cached: Optional[list[list[Block]]] = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for req's next num_new_tokens (after num_computed_tokens and any cached blocks, per group as
        get_computed_blocks gave them), plus num_lookahead_tokens slots a drafter may write ahead. Every group
        gets a real block for each new index: a step writes all its tokens' KV. New tokens past req.num_tokens
        are speculative (draft tokens): their slots are allocated but their blocks are not registered in the
        prefix cache. Returns False, changing nothing, if the pool cannot supply the blocks."""
        groups = self.req_blocks.get(req.request_id) or [[] for _ in self.windows]
        cached = cached or [[] for _ in self.windows]
        num_computed = req.num_computed_tokens + len(cached[0]) * self.block_size
        total = num_computed + num_new_tokens
        need = max(0, -(-(total + num_lookahead_tokens) // self.block_size) - len(groups[0]) - len(cached[0]))
        # touching cached free blocks takes them off the free queue
        reusable_free = sum(1 for blocks in cached for b in blocks if b.ref_cnt == 0 and b is not self.pool.null)
        if need * len(self.windows) > self.pool.num_free - reusable_free:
            return False
        for blocks, hits in zip(groups, cached):
            for b in hits:
                if b is not self.pool.null:
                    self.pool.touch(b)
            blocks.extend(hits)
            blocks.extend(self.pool.allocate() for _ in range(need))
        self.req_blocks[req.request_id] = groups
        self._register_full_blocks(req, groups, min(total, req.num_tokens))
        return True

    def _register_full_blocks(self, req: Request, groups: list[list[Block]], num_known: int) -> None:
        """Register the blocks that will be full of known tokens after this step: their content is known now, and
        a request scheduled later in the same step may share them (KV is written before attention reads it).
        Blocks are registered in order, so the unregistered ones are the tail of those: walk back to them."""
        self._update_hashes(req, num_known)
        end = num_known // self.block_size
        for g, blocks in enumerate(groups):
            start = end
            while start > 0 and blocks[start - 1].block_hash is None and blocks[start - 1] is not self.pool.null:
                start -= 1
            for i in range(start, end):
                self.pool.register(blocks[i], req.block_hashes[i], g)

    def free_out_of_window(self, req: Request) -> None:
        """After a step: each sliding group gives back the blocks no later query of req can see (all of their
        positions before num_computed_tokens - window + 1), oldest first, and keeps the null block there."""
        groups = self.req_blocks.get(req.request_id)
        if groups is None or self.pool.null is None:
            return
        for window, blocks in zip(self.windows, groups):
            if window is None:
                continue
            end = min(self._first_in_window(window, req.num_computed_tokens), len(blocks))
            start = end
            while start > 0 and blocks[start - 1] is not self.pool.null:
                start -= 1
            for i in range(start, end):
                self.pool.release(blocks[i])
                blocks[i] = self.pool.null

    def free(self, req: Request, uncache_from: Optional[int] = None) -> None:
        """uncache_from: as uncache, first."""
        if uncache_from is not None:
            self.uncache(req, uncache_from)
        for blocks in self.req_blocks.pop(req.request_id, []):
            # Tail blocks go to the free queue first, so they are evicted before the shared prefix.
            for b in reversed(blocks):
                if b is not self.pool.null:
                    self.pool.release(b)
        if not self.enable_caching:
            req.block_hashes.clear()

    def uncache(self, req: Request, position: int) -> None:
        """req's blocks holding tokens from `position` on lose their prefix-cache entry: a step that did not
        write their KV (it failed, or was cut short) registered them."""
        for blocks in self.req_blocks.get(req.request_id, []):
            for b in blocks[position // self.block_size:]:
                self.pool.unregister(b)
        del req.block_hashes[position // self.block_size:]

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its start-th block on, of its first group (a KV connector's view: the
        engine runs connectors with one group)."""
        groups = self.req_blocks.get(request_id)
        return [b.block_id for b in groups[0][start:]] if groups else []

    def new_block_ids(self, request_id: str, start: int) -> list[list[int]]:
        """Per group, the block ids from the start-th block on (the step message's delta: every group has the
        same number), or [] when there are none."""
        groups = self.req_blocks.get(request_id)
        if not groups or len(groups[0]) <= start:
            return []
        return [[b.block_id for b in blocks[start:]] for blocks in groups]

    def live_blocks(self, request_id: str) -> list[int]:
        """Per group, the blocks the request holds (not counting the null block)."""
        return [sum(b is not self.pool.null for b in blocks) for blocks in self.req_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_usable

    def is_whole(self) -> bool:
        """Every block is free (nothing leaked)."""
        return not self.req_blocks and self.pool.num_free == self.pool.num_usable
