"""Checkpoints in the `compressed-tensors` layout (llm-compressor's output, e.g. the published *-FP8 and
*-quantized.w8a8 Llama/Qwen models).

`quantization_config` = {"quant_method": "compressed-tensors", "format": "float-quantized" | "int-quantized"
| "naive-quantized", "config_groups": {name: {"targets": ["Linear" | "re:<regex>" | module name],
"weights": {"num_bits": 8, "type": "float" | "int", "strategy": "channel" | "tensor" | "block",
"symmetric": true, "block_structure": [bn, bk]}, "input_activations": {... "dynamic": true, "strategy":
"token"} | null}}, "ignore": ["lm_head", "re:..."]}. Tensors: `weight`, `weight_scale` (and `input_scale`
for static activations). Supported: 8-bit float weights (channel, tensor, block) and 8-bit symmetric int
weights per channel (weight-only, or W8A8 with dynamic per-token activations); and, in the `pack-quantized`
format, 4-bit int weights (weight-only, group or channel, symmetric or with zero points: `weight_packed`,
`weight_scale`, `weight_zero_point`, `weight_shape`), served as ggml Q4_1 blocks (awq_gptq.py).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from tokenmill.layers.quantization.awq_gptq import pack_quantized_method
from tokenmill.layers.quantization.base import QuantizationConfig, set_shard_loader
from tokenmill.layers.quantization.fp8 import Fp8LinearMethod, _row_loader
from tokenmill.layers.quantization.int8 import Int8LinearMethod


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


class _Scheme:
    def __init__(self, group_name: str, spec: dict) -> None:
        w = spec.get("weights") or {}
        self.targets = list(spec.get("targets") or [])
        self.type, self.bits = w.get("type"), w.get("num_bits")
        self.strategy = w.get("strategy")
        self.block = tuple(w["block_structure"]) if w.get("block_structure") else None
        act = spec.get("input_activations")
        self.act_dynamic = bool(act.get("dynamic", True)) if act else None  # None: weight-only
        what = f"compressed-tensors group {group_name!r}"
        self.format = spec.get("format")  # newer checkpoints name the format per group
        self.int4 = w if self.bits == 4 and self.type == "int" else None  # pack-quantized: awq_gptq.py
        if self.int4 is not None:
            if act is not None:
                raise ValueError(f"{what}: 4-bit int weights load weight-only (no input_activations)")
            pack_quantized_method(self.int4, what)  # checks the strategy and group size now
            return
        if self.bits != 8 or self.type not in ("float", "int"):
            raise ValueError(f"{what}: {self.bits}-bit {self.type} weights are not supported "
                             "(tokenmill loads 8-bit float and int weights, and 4-bit int weights)")
        if w.get("symmetric") is False:
            raise ValueError(f"{what}: asymmetric weights are not supported")
        if self.type == "float" and self.strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"{what}: float weight strategy {self.strategy!r} is not supported")
        if self.type == "float" and self.strategy == "block" and not self.block:
            raise ValueError(f"{what}: block strategy without block_structure")
        if self.type == "int" and self.strategy != "channel":
            raise ValueError(f"{what}: int8 weight strategy {self.strategy!r} is not supported (channel only)")
        if self.type == "int" and act is not None and not self.act_dynamic:
            raise ValueError(f"{what}: static int8 activation scales are not supported (dynamic only)")

    def matches(self, names: list[str]) -> bool:
        return any(t == "Linear" or any(_matches(t, n) for n in names) for t in self.targets)


class _Int8CheckpointMethod(Int8LinearMethod):
    """int8 `weight` + per-channel `weight_scale` [N, 1] as stored."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.weight_scale = set_shard_loader(nn.Parameter(torch.empty(out_features, 1), requires_grad=False),
                                              _row_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.load_quantized(layer, layer.weight.data, layer.weight_scale.data)


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"
    online = False

    def __init__(self, schemes: list[_Scheme], ignore: list[str]) -> None:
        self.schemes, self.ignore = schemes, ignore

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "CompressedTensorsConfig":
        fmt = qc.get("format")
        if fmt not in (None, "float-quantized", "int-quantized", "naive-quantized", "pack-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                             "(float-quantized, int-quantized, naive-quantized, pack-quantized)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors checkpoint has no config_groups")
        schemes = [_Scheme(n, g) for n, g in groups.items()]
        if any((s.int4 is not None) != ((s.format or fmt) == "pack-quantized") for s in schemes):  # layouts differ
            raise ValueError("compressed-tensors: 4-bit int weights load from the pack-quantized format, and "
                             f"that format holds 4-bit int weights only (format {fmt!r})")
        return cls(schemes, list(qc.get("ignore") or []))

    def _scheme(self, hf_names: list[str]) -> Optional[_Scheme]:
        ignored = [any(_matches(p, n) for p in self.ignore) for n in hf_names]
        if all(ignored):
            return None
        if any(ignored):
            raise ValueError(f"compressed-tensors ignores only part of the merged layer {hf_names}")
        return next((s for s in self.schemes if s.matches(hf_names)), None)

    def get_linear_method(self, layer, prefix, hf_names):
        s = self._scheme(hf_names)
        if s is None:
            return None
        if s.int4 is not None:
            return pack_quantized_method(s.int4, prefix)
        if s.type == "int":
            return _Int8CheckpointMethod(activations=s.act_dynamic is not None)
        return Fp8LinearMethod(s.strategy, online=False, block=s.block,
                               static_input_scale=s.act_dynamic is False)

    def describe(self) -> str:
        kinds = sorted({f"{s.type}{s.bits} {s.strategy}" + (" w8a8" if s.type == "int" and s.act_dynamic else "")
                        + (" as ggml Q4_1 blocks" if s.int4 is not None else "")
                        for s in self.schemes})
        return f"compressed-tensors ({', '.join(kinds)})"
