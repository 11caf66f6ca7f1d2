"""What a KV block's bytes mean: a fingerprint of the model and the KV layout.

A block hash names only tokens (and a salt), not the model that computed their KV nor how it is laid out, so
a stored block is valid only for a worker with the same fingerprint: the same model (path, config, weight
files' names, sizes and modification times), weights dtype and quantization, drafter, KV cache dtype, block
size, and every KV tensor's layout (layers, KV heads, head dim, dtype). Calibrated int8 KV scales are not
covered: they change per run, disk files never outlive their process (disk_store.py), and a pull from another
instance carries that instance's scales with the blocks (p2p_worker.py adopts or requantizes).

Between instances (disaggregated prefill/decode, possibly on two machines) the fingerprint is `portable`:
the same checkpoint copied elsewhere has another path and other modification times, so the files count by
name, size and a hash of their first MiB instead.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional

import torch

from tokenmill.config import EngineConfig

FINGERPRINT_BYTES = 16


def kv_fingerprint(config: EngineConfig, kv_caches: list[torch.Tensor], portable: bool = False) -> bytes:
    """kv_caches: the tensors a block spans, each [2, heads, blocks, block_size, dim] (blocks on dim 2)."""
    model, cache, spec = config.model, config.cache, config.speculative
    identity = {
        "model": None if portable else model.model,
        "model_dir": _portable_identity(model.model_dir) if portable else _files_identity(model.model_dir),
        "hf_config": model.hf_config.to_json_string() if model.hf_config is not None else None,
        "dtype": str(model.torch_dtype),
        "quantization": model.quantization,
        "drafter": None if spec is None else [spec.method, spec.quantization, _files_identity(spec.draft_model_dir)],
        "kv_cache_dtype": cache.kv_cache_dtype,
        "block_size": cache.block_size,
        "kv_layout": [[str(kv.dtype), list(kv.shape[:2]) + list(kv.shape[3:])] for kv in kv_caches],
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=FINGERPRINT_BYTES).digest()


def _files_identity(path: Optional[str]) -> Any:
    """A model directory's real path and its files' (name, size, mtime): a checkpoint rewritten in place
    changes it, without reading gigabytes of weights."""
    if not path:
        return None
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        return [real]
    stats = {e.name: e.stat() for e in os.scandir(real) if e.is_file()}
    return [real, sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats.items())]


def _portable_identity(path: Optional[str]) -> Any:
    """A model directory's files by (name, size, hash of the first MiB): equal for copies on other machines."""
    if not path or not os.path.isdir(path):
        return None
    out = []
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_file():
            with open(entry.path, "rb") as f:
                head = hashlib.blake2b(f.read(2**20), digest_size=8).hexdigest()
            out.append((entry.name, entry.stat().st_size, head))
    return out
