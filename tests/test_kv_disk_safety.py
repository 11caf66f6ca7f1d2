"""The disk KV tier in a shared directory: private permissions, no symlink following, blocks refused unless
written for the same model and KV layout, and folders left by crashed engines removed by the next start."""
import logging
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.kv_transfer.disk_store import LOCK_NAME, DiskBlockStore, remove_stale_folders
from tokenmill.kv_transfer.fingerprint import kv_fingerprint

FP = b"F" * 16
H = [bytes([i]) * 16 for i in range(40)]
BLOCK = 256


def _data(seed):
    return np.random.default_rng(seed).integers(0, 256, BLOCK, dtype=np.uint8)


def _store(root, fingerprint=FP):
    rows = np.zeros((2, BLOCK), dtype=np.uint8)
    return DiskBlockStore(str(root), rows, fingerprint), rows


def _read(store, h, slot=1):
    store.read(h, slot)
    store.flush()
    return store.finished_reads()


def test_block_files_are_private(tmp_path):
    old = os.umask(0o022)
    try:
        store, _ = _store(tmp_path)
        store.write(H[0], _data(0))
        store.flush()
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(store.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.path_of(H[0])).st_mode) == 0o600
    store.close()


def test_planted_symlinks_are_never_followed(tmp_path):
    store, rows = _store(tmp_path / "kv")
    decoys = tmp_path / "decoys"
    decoys.mkdir()
    for i in range(30):  # someone who can write in the folder plants links to files of ours
        (decoys / str(i)).write_bytes(b"precious")
        name = store.path_of(H[i]) + (".tmp" if i % 2 else "")  # the block's name, or its write's temp name
        os.symlink(decoys / str(i), name)
    for i in range(30):
        store.write(H[i], _data(i))
    store.flush()
    assert all((decoys / str(i)).read_bytes() == b"precious" for i in range(30))
    assert all(not os.path.islink(store.path_of(H[i])) for i in range(30))
    assert _read(store, H[3]) == [(H[3], True)] and np.array_equal(rows[1], _data(3))

    # A link to a valid block file outside the folder is refused on read, and only the link is removed.
    outside = tmp_path / "outside"
    os.replace(store.path_of(H[4]), outside)
    os.symlink(outside, store.path_of(H[4]))
    rows[1] = 0
    assert _read(store, H[4]) == [(H[4], False)] and not rows[1].any()
    assert not os.path.lexists(store.path_of(H[4])) and outside.exists()
    os.remove(store.path_of(H[5]))
    os.symlink(outside, store.path_of(H[5]))
    store.delete(H[5])
    store.flush()
    assert not os.path.lexists(store.path_of(H[5])) and outside.exists()
    store.close()
    assert outside.exists() and len(os.listdir(decoys)) == 30


def test_a_block_written_for_another_model_is_refused(tmp_path, caplog):
    theirs, _ = _store(tmp_path, fingerprint=b"G" * 16)
    ours, rows = _store(tmp_path)
    for i in (0, 1):
        theirs.write(H[i], _data(i))
    theirs.flush()
    for i in (0, 1):  # a file with the right name, magic, hash and checksum, but another fingerprint
        os.link(theirs.path_of(H[i]), ours.path_of(H[i]))
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        assert _read(ours, H[0]) == [(H[0], False)] and _read(ours, H[1]) == [(H[1], False)]
    assert not rows.any()  # never copied into a host slot
    assert len([r for r in caplog.records if "another model" in r.getMessage()]) == 1  # logged once
    assert not os.path.exists(ours.path_of(H[0]))
    theirs.close()
    ours.close()


def test_a_block_with_the_same_fingerprint_is_read(tmp_path):
    """The control for the test above: the same file under the same fingerprint is accepted."""
    writer, _ = _store(tmp_path)
    reader, rows = _store(tmp_path)
    writer.write(H[0], _data(0))
    writer.flush()
    os.link(writer.path_of(H[0]), reader.path_of(H[0]))
    assert _read(reader, H[0]) == [(H[0], True)] and np.array_equal(rows[1], _data(0))
    writer.close()
    reader.close()


def _config(tiny, arch="qwen2", **kw):
    return resolve_engine_config(EngineConfig.from_kwargs(model=tiny(arch), dtype="float32", **kw))


def _caches(layers=2, heads=2, dim=16, block_size=16, dtype=torch.float32):
    return [torch.zeros(2, heads, 3, block_size, dim, dtype=dtype) for _ in range(layers)]


def test_kv_fingerprint_names_the_model_and_the_kv_layout(tiny):
    base = kv_fingerprint(_config(tiny), _caches())
    assert len(base) == 16 and kv_fingerprint(_config(tiny), _caches()) == base
    others = [
        kv_fingerprint(_config(tiny, "llama"), _caches()),                   # another model
        kv_fingerprint(_config(tiny, kv_cache_dtype="int8"), _caches(dtype=torch.int8)),
        kv_fingerprint(_config(tiny, block_size=32), _caches(block_size=32)),
        kv_fingerprint(_config(tiny), _caches(layers=3)),                     # the KV layout
        kv_fingerprint(_config(tiny), _caches(heads=1, dim=32)),
        kv_fingerprint(_config(tiny), _caches(dtype=torch.bfloat16)),
    ]
    assert base not in others and len(set(others)) == len(others)


_CRASHING_ENGINE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from tokenmill.kv_transfer.disk_store import DiskBlockStore
    store = DiskBlockStore(sys.argv[1], np.zeros((1, 64), dtype=np.uint8), b"F" * 16)
    store.write(b"h" * 16, np.ones(64, dtype=np.uint8))
    store.flush()
    print(store.dir, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no exit handlers run: the folder stays behind
""")


def test_a_new_start_removes_folders_of_dead_engines_only(tmp_path):
    run = subprocess.run([sys.executable, "-c", _CRASHING_ENGINE, str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == -9, run.stderr
    crashed = run.stdout.strip()
    assert sorted(os.listdir(crashed)) == sorted([LOCK_NAME, (b"h" * 16).hex()])
    live, _ = _store(tmp_path)                                   # a running engine's folder (its lock is held)
    reused = tmp_path / f"tokenmill-kv-{os.getpid()}-reused"      # a live pid, but its owner's lock is free:
    reused.mkdir()                                               # the pid was reused after the owner died
    (reused / LOCK_NAME).touch()
    starting = tmp_path / f"tokenmill-kv-{os.getpid()}-starting"  # a live pid, no lock yet: being created
    starting.mkdir()
    unrelated = tmp_path / "tokenmill-kv-notes"
    unrelated.mkdir()

    new, _ = _store(tmp_path)
    assert not os.path.exists(crashed) and not reused.exists()
    assert os.path.isdir(live.dir) and starting.exists() and unrelated.exists()
    assert remove_stale_folders(str(tmp_path)) == []             # nothing else to remove
    live.close()
    new.close()
    assert sorted(os.listdir(tmp_path)) == sorted([starting.name, unrelated.name])
