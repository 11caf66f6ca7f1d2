"""The router's estimate of which prompt prefixes each replica holds in its KV cache.

The router never sees the replicas' blocks, so it remembers what it sent where: a request's text is cut
into fixed-size character chunks, each chunk hashed together with the hash of everything before it (as the
engine chains block hashes), and those hashes are recorded for the replica the request went to. Two
requests share a leading run of hashes exactly when they share that prefix of text. Each replica's record
is an LRU bounded by an estimate of its KV capacity, so prefixes the replica has likely evicted age out
here too.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Optional


def prefix_hashes(text: str, chunk_chars: int, salt: Optional[str] = None, model: Optional[str] = None) -> list[int]:
    """Chained hashes of the text's full chunks (a partial last chunk is not cached by a replica either).
    A salt (the request's cache_salt) starts a separate chain: salted prompts share nothing with others. So does
    the request's model name: a LoRA adapter's KV for a prompt is not the base model's (nor another adapter's)."""
    hashes, h = [], hash(("tokenmill-router", salt, model))
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hash((h, text[start:start + chunk_chars]))
        hashes.append(h)
    return hashes


class ReplicaPrefixes:
    """Prefix-chunk hashes believed cached on one replica, least recently routed first."""

    def __init__(self, capacity: Optional[int] = None) -> None:
        self.capacity = capacity  # chunks; None until the replica's KV size is known
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def matched(self, hashes: list[int]) -> int:
        """How many leading chunks of the request are cached (a chain breaks at the first miss)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        # Touch the tail first so a prefix is always more recent than its continuations: shared prefixes
        # are evicted last, as in the engine, which frees a request's blocks tail first.
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        self._evict()

    @property
    def fullness(self) -> float:
        """Share of the capacity in use (0 while the capacity is unknown)."""
        return min(1.0, len(self._lru) / self.capacity) if self.capacity else 0.0

    def set_capacity(self, capacity: Optional[int]) -> None:
        self.capacity = capacity
        self._evict()

    def clear(self) -> None:
        self._lru.clear()

    def _evict(self) -> None:
        if self.capacity is None:
            return
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


class PrefixIndex:
    """ReplicaPrefixes per replica (keyed by anything hashable: the router uses replica URLs)."""

    def __init__(self) -> None:
        self._replicas: dict[Hashable, ReplicaPrefixes] = {}

    def of(self, replica: Hashable) -> ReplicaPrefixes:
        if replica not in self._replicas:
            self._replicas[replica] = ReplicaPrefixes()
        return self._replicas[replica]

    def matched(self, replica: Hashable, hashes: list[int]) -> int:
        return self.of(replica).matched(hashes)

    def insert(self, replica: Hashable, hashes: list[int]) -> None:
        self.of(replica).insert(hashes)

    def forget(self, replica: Hashable) -> None:
        """The replica lost its cache (it went down; a restarted one starts cold)."""
        self.of(replica).clear()
