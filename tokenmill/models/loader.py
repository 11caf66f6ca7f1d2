"""Build a model from a local Hugging Face directory (config.json + one or many *.safetensors)."""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

import torch
from safetensors import safe_open

from tokenmill.distributed import tp_rank, tp_size
from tokenmill.layers.quantization import apply_quantization, get_quant_config
from tokenmill.layers.quantization.base import gather_packed_weights
from tokenmill.models import weight_cache
from tokenmill.models.registry import get_model_class
from tokenmill.startup import Ledger

logger = logging.getLogger("tokenmill")


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError) as e:
            raise ValueError(f"corrupt weight index {index}: {e}") from None
        files = [os.path.join(model_dir, n) for n in names]
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"missing weight file {f} (listed in {index})")
        return files
    files = sorted(os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weight files in {model_dir}")
    return files


def iter_weights(files: list[str]):
    """(name, whole tensor) of every checkpoint tensor (export, tools); models load through CheckpointReader."""
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"corrupt weight file {path}: {str(e).splitlines()[0]}") from None


class CheckpointTensor:
    """A checkpoint tensor not yet read: .shape, and indexing (t[a:b], t[:, a:b], t[...]) reads only the
    indexed part from the memory-mapped file, so a tensor-parallel rank reads only its slice."""

    def __init__(self, part, reader: "CheckpointReader") -> None:
        self._part, self._reader = part, reader
        self.shape = torch.Size(part.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        t = self._part[index]
        self._reader.bytes_read += t.nbytes
        return t


class CheckpointReader:
    """Iterates (name, CheckpointTensor) over safetensors files; bytes_read counts what was actually read."""

    def __init__(self, files: list[str]) -> None:
        self.files = files
        self.bytes_read = 0
        self.bytes_total = sum(os.path.getsize(f) for f in files)

    def __iter__(self):
        for path in self.files:
            try:
                f = safe_open(path, framework="pt")
                names = list(f.keys())
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                raise ValueError(f"corrupt weight file {path}: {str(e).splitlines()[0]}") from None
            for name in names:
                yield name, CheckpointTensor(f.get_slice(name), self)


def _check_loaded(model, loaded: set[str], model_dir: str) -> None:
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"weights missing from {model_dir}: {', '.join(missing[:3])}"
                         f"{' ...' if len(missing) > 3 else ''}")


def _weight_cache_file(files: list[str], cls: type, dtype: torch.dtype, device: str, quant,
                       layer_range) -> Optional[str]:
    """Where this load's weights are cached (weight_cache.py), or None: float models on the CPU whose
    checkpoint has at least weight_cache.min_bytes() (a small one loads in milliseconds anyway)."""
    if quant is not None or device != "cpu" or sum(os.path.getsize(f) for f in files) < weight_cache.min_bytes():
        return None
    key = weight_cache.cache_key(files, f"{cls.__module__}.{cls.__qualname__}", dtype, layer_range,
                                 (tp_size(), tp_rank()))
    return weight_cache.cache_path(key)


def _install_gguf(model, gguf_file: str, config, quantization: Optional[str]):
    """(quant config, quantized layer count, reader) for a GGUF served natively: its blocks are the format."""
    # GGUF only: ~7 ms of every other engine start
    from tokenmill.layers.quantization import gguf_blocks
    from tokenmill.models.gguf import GgufWeights

    if quantization is not None:
        raise ValueError(f"--quantization {quantization} cannot be applied to a GGUF served in its own blocks; "
                         "pass --gguf-weights dequantize to quantize its float weights instead")
    reader = GgufWeights(gguf_file, config)
    quant, count = gguf_blocks.install(model, reader.types)
    return quant, count, reader


def load_model(model_dir: str, config, dtype: torch.dtype, device: str, backend, max_positions: int,
               quantization: Optional[str] = None, quantize_lm_head: bool = False,
               layer_range: Optional[tuple[int, int]] = None, ledger=None):
    """quantization: an online method (int8, w8a8, fp8, mxfp4, nvfp4) applied to a float checkpoint; a
    checkpoint's own quantization_config is always honoured. quantize_lm_head: the online method covers the
    LM head too (default: it stays in `dtype`). layer_range: this pipeline stage's [start, end) of decoder
    layers (distributed.stage_layers; default the stage's even share). Each tensor-parallel rank reads only its
    slices of the checkpoint (model.checkpoint_bytes_read says how much it read). ledger (startup.Ledger) gets
the phases "weight load" and "weight packing"."""
    t0 = time.perf_counter()
    ledger = ledger or Ledger(origin=0.0)
    cls = get_model_class(config)
    gguf_file = getattr(config, "tokenmill_gguf_file", None)  # a GGUF served in its own blocks (models/gguf.py)
    with ledger.phase("weight load"):
        with torch.device(device):
            model = cls(config, dtype, backend, max_positions, layer_range=layer_range)
        if gguf_file:
            quant, nquant, reader = _install_gguf(model, gguf_file, config, quantization)
            cached = None  # the file is already mapped: nothing to cache
        else:
            quant = get_quant_config(quantization, config)
            if quant is not None:
                nquant = apply_quantization(model, quant, quantize_lm_head)
            files = weight_files(model_dir)
            cached = _weight_cache_file(files, cls, dtype, device, quant, layer_range)
        mapped = weight_cache.load_into(model, cached) if cached and os.path.isfile(cached) else None
        if mapped is None:
            reader = reader if gguf_file else CheckpointReader(files)
            _check_loaded(model, model.load_weights(reader), model_dir)
    if mapped is None and cached:
        with ledger.phase("weight cache write"):  # once: later starts map it (weight_cache.py)
            weight_cache.save(model, cached)
    model.checkpoint_bytes_read = reader.bytes_read if mapped is None else 0
    model.eval()
    with ledger.phase("weight packing"):
        for module in model.modules():  # repack/quantize weights now that they are final
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        if quant is not None:
            gather_packed_weights(model)
        if hasattr(model, "process_weights_after_loading"):
            model.process_weights_after_loading()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if gguf_file:  # its blocks are views of the file, not parameters
        from tokenmill.layers.quantization.gguf_blocks import block_bytes  # GGUF only, as in _install_gguf

        nbytes += block_bytes(model)
    if quant is not None:
        head = "" if not quant.online else " (LM head included)" if quantize_lm_head else \
            " (LM head in the model dtype; --quantize-lm-head includes it)"
        logger.info("quantization: %s on %d linear layers%s", quant.describe(), nquant, head)
    source = (f"mapped from the weight cache {cached}" if mapped is not None else
              f"read {reader.bytes_read / 1e6:.1f} of the checkpoint's {reader.bytes_total / 1e6:.1f} MB")
    logger.info("loaded %s (%s, %.1f MB of weights; %s) in %.1fs", cls.__name__, str(dtype).removeprefix("torch."),
                nbytes / 1e6, source, time.perf_counter() - t0)
    return model
