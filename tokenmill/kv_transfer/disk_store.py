"""Disk tier storage: one file per KV block, checksummed, written and read on a background thread.

A file is a header (magic, the block's hash, CRC-32 of the payload) followed by the block's bytes. A read
checks all three and the length, so a flipped byte, a truncated or missing file, or a file for another block
is caught, reported as failed, and the block is recomputed. CRC-32 guards against accidents, not attacks, at
~5x blake2b's speed (a 4096-token prefix of the default model is ~190 MB to check).

One I/O thread runs writes, reads and deletes in the order they were submitted, so a read always sees the
writes decided before it; the engine step never waits for it (except when a backlog of writes outgrows
MAX_PENDING_WRITE_BYTES, which throttles eviction to disk speed). Files live in a private folder under the
configured directory, removed when the store closes or the process exits: block hashes do not name the
model, so files are never shared between runs.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
import zlib
from typing import Optional

import numpy as np

from tokenmill.kv_transfer.offload_plan import DELETE, READ, WRITE

logger = logging.getLogger("tokenmill")

MAGIC = b"TMKVBLK1"
HASH_BYTES = 16
CHECKSUM_BYTES = 4
HEADER_BYTES = len(MAGIC) + HASH_BYTES + CHECKSUM_BYTES
MAX_PENDING_WRITE_BYTES = 256 * 2**20


def _checksum(data) -> bytes:
    return zlib.crc32(data).to_bytes(CHECKSUM_BYTES, "little")


class DiskBlockStore:
    def __init__(self, root: str, rows: np.ndarray) -> None:
        """rows: the host slots ([slots, block bytes]) that reads fill."""
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="tokenmill-kv-", dir=root)
        self.block_nbytes = rows.shape[1]
        self._ops: queue.Queue = queue.Queue(maxsize=max(4, MAX_PENDING_WRITE_BYTES // self.block_nbytes))
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.reads_in_flight = 0
        self._thread = threading.Thread(target=_io_loop, args=(self.dir, rows, self._ops, self._done),
                                        name="tokenmill-kv-disk", daemon=True)
        self._thread.start()
        self._cleanup = weakref.finalize(self, _close, self._ops, self._thread, self.dir)

    def path_of(self, block_hash: bytes) -> str:
        return _path(self.dir, block_hash)

    def write(self, block_hash: bytes, data: np.ndarray) -> None:
        """data: the block's bytes, owned by the store from now on (a snapshot, not a live slot)."""
        self._ops.put((WRITE, block_hash, data))

    def read(self, block_hash: bytes, slot: int) -> None:
        self.reads_in_flight += 1
        self._ops.put((READ, block_hash, slot))

    def delete(self, block_hash: bytes) -> None:
        self._ops.put((DELETE, block_hash, None))

    def finished_reads(self, wait: bool = False) -> list[tuple[bytes, bool]]:
        out = []
        try:
            if wait and self.reads_in_flight:
                out.append(self._done.get(timeout=0.01))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.reads_in_flight -= len(out)
        return out

    def flush(self) -> None:
        """Wait until every submitted operation ran (tests, benchmarks)."""
        self._ops.join()

    def close(self) -> None:
        self._cleanup()


def _path(directory: str, block_hash: bytes) -> str:
    return os.path.join(directory, block_hash.hex())


def _io_loop(directory: str, rows: np.ndarray, ops: queue.Queue, done: queue.SimpleQueue) -> None:
    warned_write = False
    while True:
        op = ops.get()
        try:
            if op is None:
                return
            kind, block_hash, arg = op
            path = _path(directory, block_hash)
            if kind == WRITE:
                try:
                    with open(path, "wb") as f:
                        f.write(MAGIC + block_hash + _checksum(arg))
                        f.write(memoryview(arg))
                except OSError as e:  # the index still lists the block; its read will fail and recompute
                    if not warned_write:
                        logger.warning("KV disk tier: cannot write %s (%s); such blocks will be recomputed", path, e)
                        warned_write = True
            elif kind == READ:
                problem = _read_block(path, block_hash, rows[arg])
                if problem is not None:
                    logger.warning("KV disk tier: block %s %s; recomputing it", block_hash.hex(), problem)
                    _remove(path)
                done.put((block_hash, problem is None))
            else:
                _remove(path)
        except Exception:  # noqa: BLE001 - keep serving; a read must always be answered
            logger.exception("KV disk tier: %s failed", op[0] if op else op)
            if op is not None and op[0] == READ:
                done.put((op[1], False))
        finally:
            ops.task_done()


def _read_block(path: str, block_hash: bytes, out: np.ndarray) -> Optional[str]:
    """Fill out with the block's bytes; None if intact, else what is wrong."""
    try:
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
            n = f.readinto(memoryview(out))
            extra = f.read(1)
    except FileNotFoundError:
        return "is missing on disk"
    except OSError as e:
        return f"cannot be read ({e})"
    if len(header) != HEADER_BYTES or n != out.nbytes or extra:
        return "has the wrong size on disk"
    if header[:len(MAGIC)] != MAGIC or header[len(MAGIC):len(MAGIC) + HASH_BYTES] != block_hash:
        return "has a bad header on disk"
    if header[len(MAGIC) + HASH_BYTES:] != _checksum(out):
        return "failed its checksum"
    return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _close(ops: queue.Queue, thread: threading.Thread, directory: str) -> None:
    ops.put(None)
    thread.join(timeout=30)
    shutil.rmtree(directory, ignore_errors=True)
