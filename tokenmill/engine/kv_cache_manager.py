"""Paged KV block accounting: block pool with ref counts, hash-chain prefix cache, LRU of free blocks.

Invariants:
- A block with ref_cnt > 0 is owned by at least one running request and is never in the free queue.
- A block in the free queue may still hold valid cached KV (block_hash set); it is reused on a prefix
  hit, or evicted (hash dropped) from the front of the queue when a fresh block is needed.
- Every block a request owns returns to the pool when the request finishes, aborts or is preempted.
- Evicting a block's cached content is announced (on_evict) before the block is reused, so a KV connector
  can copy it to a lower tier first (tokenmill/kv_transfer).
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Callable, Optional

from tokenmill.messages import Request


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
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Optional[Callable[[int, bytes], None]] = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)  # LRU first
        self.cached: dict[bytes, Block] = {}
        self.on_evict = on_evict  # (block id, hash): a KV connector may save the content first

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> Block:
        _, block = self.free.popitem(last=False)
        if block.block_hash is not None:  # evict its cached content
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
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

    def register(self, block: Block, block_hash: bytes) -> None:
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def unregister(self, block: Block) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 on_evict: Optional[Callable[[int, bytes], None]] = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, on_evict)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_hits = 0
        self.num_external_queries = 0  # prompt tokens past the device hit asked of a KV connector (lower tiers)
        self.num_external_hits = 0

    # -- prefix cache ---------------------------------------------------------------------
    def _extra_key(self, req: Request) -> Optional[str]:
        # Without prefix caching a request shares only with itself (after preemption) and with the
        # siblings of an n>1 request, to which the front gives one salt.
        return req.cache_salt if self.enable_caching else (req.cache_salt or f"\0{req.request_id}")

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        bs, hashes = self.block_size, req.block_hashes
        extra = self._extra_key(req)
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, req.all_token_ids[i * bs:(i + 1) * bs], extra))

    @staticmethod
    def reuses_cache(req: Request) -> bool:
        """A request reporting prompt logprobs needs logits for every prompt position: it computes them all."""
        return req.sampling_params.prompt_logprobs is None

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest run of cached full blocks at the start of the request. At least one token is always
        left to compute (its logits start generation)."""
        if not self.reuses_cache(req):
            return [], 0
        self._update_hashes(req, req.num_tokens)
        hits: list[Block] = []
        for h in req.block_hashes[:(req.num_tokens - 1) // self.block_size]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int, num_external_tokens: Optional[int] = None) -> None:
        """num_external_tokens: what a KV connector supplied after the device hit (None: no connector)."""
        if self.enable_caching:
            self.num_queries += num_tokens
            self.num_hits += num_hit_tokens
            if num_external_tokens is not None:
                self.num_external_queries += num_tokens - num_hit_tokens
                self.num_external_hits += num_external_tokens

    # -- allocation -----------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, cached: Optional[list[Block]] = None,
                       num_lookahead_tokens: int = 0) -> bool:
        """Make room for req's next num_new_tokens (after num_computed_tokens and any cached blocks), plus
        num_lookahead_tokens slots a drafter may write ahead. New tokens past req.num_tokens are speculative
        (draft tokens): their slots are allocated but their blocks are not registered in the prefix cache.
        Returns False, changing nothing, if the pool cannot supply the blocks."""
        cached = cached or []
        blocks = self.req_blocks.setdefault(req.request_id, [])
        num_computed = req.num_computed_tokens + len(cached) * self.block_size
        total = num_computed + num_new_tokens
        need = -(-(total + num_lookahead_tokens) // self.block_size) - len(blocks) - len(cached)
        reusable_free = sum(1 for b in cached if b.ref_cnt == 0)  # touching them takes them off the free queue
        if need > self.pool.num_free - reusable_free:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        for b in cached:
            self.pool.touch(b)
        blocks.extend(cached)
        blocks.extend(self.pool.allocate() for _ in range(max(need, 0)))
        # Register blocks that will be full after this step: their tokens are all known now, and a request
        # scheduled later in the same step may share them (KV is written before attention reads it).
        total = min(total, req.num_tokens)
        self._update_hashes(req, total)
        for i in range(total // self.block_size):
            if blocks[i].block_hash is None:
                self.pool.register(blocks[i], req.block_hashes[i])
        return True

    def free(self, req: Request, uncache_from: Optional[int] = None) -> None:
        """uncache_from: blocks holding tokens from this position on lose their prefix-cache entry (a step
        that failed before writing their KV registered them)."""
        blocks = self.req_blocks.pop(req.request_id, [])
        if uncache_from is not None:
            for b in blocks[uncache_from // self.block_size:]:
                self.pool.unregister(b)
            del req.block_hashes[uncache_from // self.block_size:]
        # Tail blocks go to the free queue first, so they are evicted before the shared prefix.
        for b in reversed(blocks):
            self.pool.release(b)
        if not self.enable_caching:
            req.block_hashes.clear()

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block ids from its start-th block on (the step message sends only the new ones)."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())[start:]]

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.num_blocks

    def is_whole(self) -> bool:
        """Every block is free (nothing leaked)."""
        return not self.req_blocks and self.pool.num_free == self.num_blocks
