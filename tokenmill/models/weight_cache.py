"""Loaded weights cached on disk in the serving dtype and layout, mapped back zero-copy on the next start.

A checkpoint is often stored in another dtype than the one served (the default model's GGUF is converted to
float32 safetensors; the server runs bfloat16), so every start used to read it whole and convert each tensor
into freshly allocated parameters. After a first load, the model's state as loaded (this rank's slices, this
dtype, before any repacking) is written once to $TOKENMILL_CACHE_DIR/weights/<key>.safetensors; later starts
map that file copy-on-write (MAP_PRIVATE) and let the parameters point into the mapping: nothing is read or
copied until a page is first touched, and the pages are the page cache's own (no second copy in RAM).

The key hashes the checkpoint files' identities (path, size, mtime), the dtype, the model class, this rank's
layers and tensor-parallel slice, and FORMAT_VERSION (bump it when loading changes what a parameter holds).
Only float CPU models use it (quantized layers' state is not plain parameters), and only checkpoints of
TOKENMILL_WEIGHT_CACHE_MIN_MB (default 64) or more: a small one loads in milliseconds and would only fill the
cache. TOKENMILL_WEIGHT_CACHE_MIN_MB=off turns it off. Files are never removed automatically: each model and
dtype served adds one file of the weights' size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from typing import Optional

import torch

from tokenmill.host import cache_root

logger = logging.getLogger("tokenmill")

FORMAT_VERSION = 1
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def min_bytes() -> float:
    """Smallest checkpoint (bytes) whose load is cached; infinite when the cache is off."""
    value = os.environ.get("TOKENMILL_WEIGHT_CACHE_MIN_MB", "64")
    if value.lower() == "off":
        return float("inf")
    try:
        return float(value) * 2**20
    except ValueError:
        raise ValueError(f"TOKENMILL_WEIGHT_CACHE_MIN_MB={value!r}: give a number of MB or 'off'") from None


def cache_key(files: list[str], model_cls: str, dtype: torch.dtype, layer_range, tp: tuple[int, int]) -> str:
    ident = [(os.path.realpath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]
    blob = json.dumps([FORMAT_VERSION, ident, model_cls, str(dtype), list(layer_range or ()), list(tp)])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cache_path(key: str) -> str:
    return os.path.join(cache_root(), "weights", f"{key}.safetensors")


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer once (a tied one, LM head = embedding, under its first name)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def save(model: torch.nn.Module, path: str) -> None:
    """Write the model's tensors atomically; a failure only costs the next start its speed."""
    from safetensors.torch import save_file

    state = {name: t.detach().contiguous() for name, t in _named_tensors(model).items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(state, tmp, metadata={"format_version": str(FORMAT_VERSION)})
        os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError) as e:  # disk full, tensors safetensors will not write...
        logger.warning("could not cache the loaded weights in %s: %s", path, e)
        if os.path.exists(tmp):
            os.remove(tmp)


def _mapped_tensors(path: str) -> dict[str, torch.Tensor]:
    """name -> tensor viewing a MAP_PRIVATE mapping of the safetensors file (safetensors orders tensors by
    alignment, so every view starts on a multiple of its element size)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ValueError("not a safetensors file (header length beyond its end)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    raw = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    base = 8 + n
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        out[name] = raw[base + start:base + end].view(_DTYPES[info["dtype"]]).view(info["shape"])
    return out


def load_into(model: torch.nn.Module, path: str) -> Optional[int]:
    """Point the model's parameters and buffers at the cached file's mapping; the mapped bytes, or None
    when the file does not fit this model (then nothing was changed)."""
    try:
        tensors = _mapped_tensors(path)
    except (OSError, ValueError, KeyError, RuntimeError, struct.error) as e:
        logger.warning("ignoring the unreadable weight cache %s: %s", path, e)
        return None
    targets = _named_tensors(model)
    if set(targets) != set(tensors) or any(tensors[n].shape != t.shape or tensors[n].dtype != t.dtype
                                           for n, t in targets.items()):
        logger.warning("ignoring the weight cache %s: it does not match the model", path)
        return None
    with torch.no_grad():
        for name, t in targets.items():  # the same Parameter objects, so ties stay ties
            t.data = tensors[name]
    return os.path.getsize(path)
