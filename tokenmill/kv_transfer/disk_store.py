"""Disk tier storage: one file per KV block, checksummed, written and read on a background thread.

A file is a header (magic, the KV fingerprint, the block's hash, CRC-32 of the payload) followed by the
block's bytes. A read checks all four and the length, so a flipped byte, a truncated or missing file, a file
for another block, or one written for another model or KV layout (fingerprint.py) is caught, reported as
failed, and the block is recomputed. CRC-32 guards against accidents, not attacks, at ~5x blake2b's speed (a
4096-token prefix of the default model is ~190 MB to check).

One I/O thread runs writes, reads and deletes in the order they were submitted, so a read always sees the
writes decided before it; the engine step never waits for it (except when a backlog of writes outgrows
MAX_PENDING_WRITE_BYTES, which throttles eviction to disk speed).

Files live in a private folder (0700, files 0600) under the configured directory, named
`tokenmill-kv-<pid>-<random>` and removed when the store closes or the process exits. A process that dies
without cleaning up (a crash, SIGKILL) leaves its folder behind: the next store started on that directory
removes it (`remove_stale_folders`). The configured directory may be shared (/tmp), so every file is opened
relative to the private folder's descriptor, never following a symlink: a symlink planted there is refused
on read and replaced, not followed, on write (a write goes to a fresh temporary file renamed into place).
File names are the block hashes in hex, nothing from a request.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import queue
import re
import shutil
import stat
import tempfile
import threading
import weakref
import zlib
from typing import Optional

import numpy as np

from tokenmill.kv_transfer.fingerprint import FINGERPRINT_BYTES
from tokenmill.step.offload_plan import DELETE, READ, WRITE

logger = logging.getLogger("tokenmill")

MAGIC = b"TMKVBLK2"
HASH_BYTES = 16
CHECKSUM_BYTES = 4
HEADER_BYTES = len(MAGIC) + FINGERPRINT_BYTES + HASH_BYTES + CHECKSUM_BYTES
MAX_PENDING_WRITE_BYTES = 256 * 2**20
FOLDER_PREFIX = "tokenmill-kv-"
_FOLDER_NAME = re.compile(re.escape(FOLDER_PREFIX) + r"(\d+)-[A-Za-z0-9_]+")
LOCK_NAME = "owner.lock"  # held (flock) by the owning process for its whole life
FOREIGN = "was written for another model or KV layout"
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def _checksum(data) -> bytes:
    return zlib.crc32(data).to_bytes(CHECKSUM_BYTES, "little")


class DiskBlockStore:
    def __init__(self, root: str, rows: np.ndarray, fingerprint: bytes) -> None:
        """rows: the host slots ([slots, block bytes]) that reads fill; fingerprint: what the blocks' bytes mean
        (fingerprint.kv_fingerprint), written into every file and required of every file read."""
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"a KV fingerprint is {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        os.makedirs(root, mode=0o700, exist_ok=True)
        remove_stale_folders(root)
        self.dir, dir_fd, lock_fd = _make_private_folder(root)
        self.block_nbytes = rows.shape[1]
        self._ops: queue.Queue = queue.Queue(maxsize=max(4, MAX_PENDING_WRITE_BYTES // self.block_nbytes))
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.reads_in_flight = 0
        files = _BlockFiles(dir_fd, fingerprint, rows)
        self._thread = threading.Thread(target=_io_loop, args=(files, self._ops, self._done),
                                        name="tokenmill-kv-disk", daemon=True)
        self._thread.start()
        self._cleanup = weakref.finalize(self, _close, self._ops, self._thread, self.dir, dir_fd, lock_fd)

    def path_of(self, block_hash: bytes) -> str:
        return os.path.join(self.dir, _name(block_hash))

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


def _name(block_hash: bytes) -> str:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")
    return block_hash.hex()


# -- the private folder -----------------------------------------------------------------------------
def _make_private_folder(root: str) -> tuple[str, int, int]:
    """Create this process's folder: (path, its descriptor, the held owner lock's descriptor)."""
    path = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=root)  # 0700, never an existing one
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    st = os.fstat(dir_fd)
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:  # swapped under us in a shared root
        os.close(dir_fd)
        raise RuntimeError(f"KV disk tier: {path} is not a private folder of this user; refusing to use it")
    try:
        return path, dir_fd, _hold_owner_lock(dir_fd)
    except BaseException:
        os.close(dir_fd)
        shutil.rmtree(path, ignore_errors=True)
        raise


def _hold_owner_lock(dir_fd: int) -> int:
    """Lock the folder for this process's life. Locked under a temporary name, then renamed: while its owner
    lives, LOCK_NAME never exists unlocked, so `remove_stale_folders` can trust an unlocked one."""
    fd = os.open(LOCK_NAME + ".new", os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600, dir_fd=dir_fd)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(LOCK_NAME + ".new", LOCK_NAME, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return fd


def remove_stale_folders(root: str) -> list[str]:
    """Remove the private folders of processes that died without removing them; returns their paths. Only
    this user's `tokenmill-kv-<pid>-*` directories are considered, and only dead owners' are removed."""
    removed = []
    for entry in os.scandir(root):
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None or not _is_own_directory(entry.path):
            continue
        if not _owner_alive(entry.path, int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)  # fd-based on Linux: never follows a symlink
            removed.append(entry.path)
    if removed:
        logger.info("KV disk tier: removed %d folder(s) left by dead processes in %s", len(removed), root)
    return removed


def _is_own_directory(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _owner_alive(path: str, pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's process
        pass
    # The pid is alive, but it may have been reused since the owner died: the owner holds its lock.
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | _OPEN_FLAGS)
    except OSError:  # no lock yet: the owner is still creating its folder
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# -- block files (the I/O thread) -------------------------------------------------------------------
class _BlockFiles:
    """Block files inside the private folder, opened relative to its descriptor, never through a symlink."""

    def __init__(self, dir_fd: int, fingerprint: bytes, rows: np.ndarray) -> None:
        self.dir_fd = dir_fd
        self.fingerprint = fingerprint
        self.rows = rows
        self.warned_write = False
        self.warned_foreign = False

    def write(self, block_hash: bytes, data: np.ndarray) -> None:
        name = _name(block_hash)
        tmp = name + ".tmp"
        try:
            with os.fdopen(self._create(tmp), "wb") as f:
                f.write(MAGIC + self.fingerprint + block_hash + _checksum(data))
                f.write(memoryview(data))
            os.rename(tmp, name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)  # replaces a planted link
        except OSError as e:  # the index still lists the block; its read will fail and recompute
            self.remove(tmp)
            if not self.warned_write:
                logger.warning("KV disk tier: cannot write block %s (%s); such blocks will be recomputed", name, e)
                self.warned_write = True

    def _create(self, name: str) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS
        try:
            return os.open(name, flags, 0o600, dir_fd=self.dir_fd)
        except FileExistsError:  # left by a failed write, or planted: remove it (never follow it) and retry
            self.remove(name)
            return os.open(name, flags, 0o600, dir_fd=self.dir_fd)

    def read(self, block_hash: bytes, slot: int) -> bool:
        problem = self._read_into(block_hash, self.rows[slot])
        if problem is None:
            return True
        if problem != FOREIGN:
            logger.warning("KV disk tier: block %s %s; recomputing it", block_hash.hex(), problem)
        elif not self.warned_foreign:
            logger.warning("KV disk tier: block %s %s; refusing it and any such file (recomputed)",
                           block_hash.hex(), problem)
            self.warned_foreign = True
        self.remove(_name(block_hash))
        return False

    def _read_into(self, block_hash: bytes, out: np.ndarray) -> Optional[str]:
        """Fill out with the block's bytes; None if intact, else what is wrong (out untouched if the header
        is wrong)."""
        try:
            fd = os.open(_name(block_hash), os.O_RDONLY | os.O_NONBLOCK | _OPEN_FLAGS, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return "is missing on disk"
        except OSError as e:
            return "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e})"
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return "is not a regular file"
            header = f.read(HEADER_BYTES)
            problem = self._check_header(header, block_hash)
            if problem is not None:
                return problem
            n = f.readinto(memoryview(out))
            extra = f.read(1)
        if n != out.nbytes or extra:
            return "has the wrong size on disk"
        if header[-CHECKSUM_BYTES:] != _checksum(out):
            return "failed its checksum"
        return None

    def _check_header(self, header: bytes, block_hash: bytes) -> Optional[str]:
        if len(header) != HEADER_BYTES:
            return "has the wrong size on disk"
        fingerprint_at = len(MAGIC)
        hash_at = fingerprint_at + FINGERPRINT_BYTES
        if header[:fingerprint_at] != MAGIC or header[hash_at:hash_at + HASH_BYTES] != block_hash:
            return "has a bad header on disk"
        if header[fingerprint_at:hash_at] != self.fingerprint:
            return FOREIGN
        return None

    def remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.dir_fd)  # removes a symlink itself, never its target
        except FileNotFoundError:
            pass


def _io_loop(files: _BlockFiles, ops: queue.Queue, done: queue.SimpleQueue) -> None:
    while True:
        op = ops.get()
        try:
            if op is None:
                return
            kind, block_hash, arg = op
            if kind == WRITE:
                files.write(block_hash, arg)
            elif kind == READ:
                done.put((block_hash, files.read(block_hash, arg)))
            else:
                files.remove(_name(block_hash))
        except Exception:  # noqa: BLE001 - keep serving; a read must always be answered
            logger.exception("KV disk tier: %s failed", op[0] if op else op)
            if op is not None and op[0] == READ:
                done.put((op[1], False))
        finally:
            ops.task_done()


def _close(ops: queue.Queue, thread: threading.Thread, directory: str, dir_fd: int, lock_fd: int) -> None:
    ops.put(None)
    thread.join(timeout=30)
    shutil.rmtree(directory, ignore_errors=True)
    if not thread.is_alive():  # a stuck thread keeps its descriptor: a reused number would misdirect it
        os.close(dir_fd)
    os.close(lock_fd)  # last: until the folder is gone, a new start sees its owner alive
