"""Which cached block follows which: the host tier's view of prefix chains, for its eviction order.

A prefix lookup stops at the first miss, so a block is worth keeping only while its ancestors are kept, and a
block whose children are resident is worth more than a leaf. Block hashes do not reveal their parent, so the
links are learned from the requests the connector sees (their hash chains, at lookup and at release) and
remembered for the most recent MEMORY blocks (the ones still in the device cache that may be evicted to the
host tier next). A block whose link was forgotten counts as the first of its chain: the policy only weakens
to plain LRU for it.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Optional

MEMORY = 1 << 16  # learned links kept beyond the host tier's own blocks (~100 bytes each)
UNKNOWN = (None, 0)  # a forgotten link: as if the block started its chain


class BlockChains:
    def __init__(self, num_host_blocks: int) -> None:
        self.memory = MEMORY + num_host_blocks
        # hash -> (parent, position in its chain): learned ones (most recent last), and the host tier's blocks'
        self.learned: OrderedDict[bytes, tuple[Optional[bytes], int]] = OrderedDict()
        self.resident: dict[bytes, tuple[Optional[bytes], int]] = {}
        self.host_children: Counter[bytes] = Counter()  # block -> how many of its children the host tier holds

    def learn(self, chain: list[bytes]) -> None:
        """chain: a request's block hashes from its first block."""
        parent = None
        for i, h in enumerate(chain):
            self.learned[h] = (parent, i)
            self.learned.move_to_end(h)
            parent = h
        while len(self.learned) > self.memory:
            self.learned.popitem(last=False)

    def entered_host(self, block_hash: bytes) -> None:
        parent, _ = self.resident[block_hash] = self.learned.get(block_hash, UNKNOWN)
        if parent is not None:
            self.host_children[parent] += 1

    def left_host(self, block_hash: bytes) -> None:
        parent, _ = self.resident.pop(block_hash)
        if parent is not None:
            self.host_children[parent] -= 1
            if not self.host_children[parent]:
                del self.host_children[parent]

    def is_leaf(self, block_hash: bytes) -> bool:
        """No child of the block is in the host tier: evicting it strands nothing there."""
        return not self.host_children[block_hash]

    def eviction_rank(self, block_hash: bytes) -> tuple[bool, int]:
        """Among blocks equally recent, the higher goes first: a leaf before a parent, then the one farthest
        from its chain's start."""
        _, position = self.resident.get(block_hash) or self.learned.get(block_hash, UNKNOWN)
        return self.is_leaf(block_hash), position
