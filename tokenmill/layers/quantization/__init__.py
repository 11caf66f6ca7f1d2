"""Weight quantization: a registry of formats and the step that installs them on a model's linear layers.

Online (`--quantization`, applied on load to a float checkpoint): int8 (weight-only), w8a8, fp8, mxfp4,
nvfp4, int4 (and int4-g128; ggml Q4_1 blocks, int4.py). Pre-quantized checkpoints, recognised from
config.json's `quantization_config`: `fp8`, `compressed-tensors`, int4 `awq` / `gptq` (awq_gptq.py), and
`mxfp4` MoE experts (gpt-oss; fp4.py). Models never branch on any of this: every LinearBase gets a quant_method
from the config, and the method owns the weights and the matmul. Online quantization leaves the LM head in the model's
dtype (as vLLM does) unless asked to include it (`--quantize-lm-head`); a checkpoint's own `ignore` list
decides for its head.
"""
from __future__ import annotations

import logging
from typing import Optional

from torch import nn

from tokenmill.layers.linear import LinearBase
from tokenmill.layers.quantization.base import QuantizationConfig
from tokenmill.layers.quantization.int8 import Int8Config

logger = logging.getLogger("tokenmill")

ONLINE_METHODS = ("int8", "w8a8", "fp8", "mxfp4", "nvfp4", "int4", "int4-g128")
CHECKPOINT_METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")


def checkpoint_quant_config(hf_config) -> Optional[dict]:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return qc if isinstance(qc, dict) else qc.to_dict()


def get_quant_config(method: Optional[str], hf_config=None) -> Optional[QuantizationConfig]:
    """The config for a checkpoint (its own quantization_config wins) or for an online --quantization method.
    Validation of the combination and its messages live in tokenmill.config.validate_quantization."""
    qc = checkpoint_quant_config(hf_config) if hf_config is not None else None
    if qc is not None:
        kind = qc.get("quant_method")
        if kind == "fp8":
            from tokenmill.layers.quantization.fp8 import Fp8Config  # ~2 ms of engine start: fp8 checkpoints only

            return Fp8Config.from_checkpoint(qc)
        if kind == "compressed-tensors":
            # Cycle at import time: compressed_tensors -> awq_gptq -> int4 -> fused_moe, which imports this package
            from tokenmill.layers.quantization.compressed_tensors import CompressedTensorsConfig

            return CompressedTensorsConfig.from_checkpoint(qc)
        if kind in ("awq", "gptq"):
            # Cycle at import time: awq_gptq -> int4 -> fused_moe, which imports this package
            from tokenmill.layers.quantization.awq_gptq import AwqConfig, GptqConfig

            return (AwqConfig if kind == "awq" else GptqConfig).from_checkpoint(qc)
        if kind == "mxfp4":
            # ~1 ms of engine start, and fp4 -> fused_moe imports this package: mxfp4 checkpoints only
            from tokenmill.layers.quantization.fp4 import Mxfp4CheckpointConfig

            return Mxfp4CheckpointConfig()
        raise ValueError(f"checkpoint quantization {kind!r} is not supported "
                         f"(tokenmill loads {', '.join(CHECKPOINT_METHODS)})")
    if method is None:
        return None
    if method in ("int8", "w8a8"):
        return Int8Config(activations=method == "w8a8")
    if method == "fp8":
        from tokenmill.layers.quantization.fp8 import Fp8Config  # ~2 ms of engine start, as above

        return Fp8Config(online=True)
    if method in ("mxfp4", "nvfp4"):
        from tokenmill.layers.quantization.fp4 import Fp4Config  # ~1 ms of engine start: fp4 only

        return Fp4Config(method)
    if method in ("int4", "int4-g128"):
        from tokenmill.layers.quantization.int4 import Int4Config  # cycle at import time: int4 -> fused_moe -> here

        return Int4Config(method)
    raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(ONLINE_METHODS)}")


def _hf_names(model: nn.Module, prefix: str) -> list[str]:
    """Checkpoint module names a (possibly merged) layer of ours stands for."""
    merged: dict[str, list[tuple[int, str]]] = {}
    for logical, (target, shard) in getattr(model, "_MERGED", {}).items():
        merged.setdefault(target, []).append((shard, logical))
    head, _, last = prefix.rpartition(".")
    names = [f"{head}.{n}" if head else n for _, n in sorted(merged[last])] if last in merged else [prefix]
    return [n if n.startswith("lm_head") else f"model.{n}" for n in names]


LM_HEAD = "lm_head"


def is_lm_head(prefix: str) -> bool:
    return prefix.rpartition(".")[2] == LM_HEAD


def apply_quantization(model: nn.Module, config: QuantizationConfig, quantize_lm_head: bool = False) -> int:
    """Install config's quant methods on the model's linear layers (before its weights load). Returns how
    many layers were quantized. Online methods skip the LM head unless quantize_lm_head: it keeps the model
    dtype and the float path (UnquantizedLinearMethod, CPU-packed; tied, it stays the embedding's tensor)."""
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    count = 0
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        if config.online and not quantize_lm_head and is_lm_head(prefix):
            continue
        method = config.get_linear_method(layer, prefix, _hf_names(model, prefix))
        if method is None:
            continue
        tied = len(shared.get(id(layer.weight), [])) > 1
        if not config.online and tied:
            continue  # a tied head has no tensors of its own in the checkpoint: it stays the float embedding
        layer.quant_method = method
        if not config.online:
            dtype = layer.weight.dtype
            del layer.weight
            method.create_weights(layer, layer.in_features, layer.out_features, dtype)
        count += 1
    return count + _quantize_experts(model, config)


def _quantize_experts(model: nn.Module, config: QuantizationConfig) -> int:
    """MoE experts (layers/fused_moe.py) take int8 weight-only under --quantization int8 and Q4_1 blocks under
    int4 (where their sizes are whole groups); another online method leaves them in the model dtype, said
    once."""
    from tokenmill.layers.fused_moe import FusedMoE, Int8MoEMethod  # cycle at import time: it imports this package

    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not moes:
        return 0
    if not config.online:  # a checkpoint format: its tensors need its method's parameters before they load
        methods = [(moe, config.get_moe_method(moe)) for moe in moes]
        for moe, method in methods:
            if method is not None:
                moe.use_quant_method(method)
        return sum(method is not None for _, method in methods)
    if getattr(config, "name", None) in ("int4", "int4-g128"):
        from tokenmill.layers.quantization.int4 import Int4MoEMethod  # cycle at import time, as Int4Config

        if all(Int4MoEMethod.fits(m, config.group) for m in moes):
            for moe in moes:
                moe.quant_method = Int4MoEMethod(config.group)
            return len(moes)
        logger.warning("--quantization %s: the MoE experts' sizes are not multiples of %d (per tensor-parallel "
                       "rank): they stay in the model dtype", config.name, config.group)
        return 0
    if getattr(config, "name", None) != "int8":
        logger.warning("--quantization %s does not cover MoE experts yet: they stay in the model dtype (int8 "
                       "and int4 do)", getattr(config, "name", config))
        return 0
    for moe in moes:  # same float weights at load; quantized per expert in process_weights_after_loading
        moe.quant_method = Int8MoEMethod()
    return len(moes)
