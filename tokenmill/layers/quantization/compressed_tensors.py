"""Checkpoints in the `compressed-tensors` layout (llm-compressor's output, e.g. the published *-FP8 and
*-quantized.w8a8 Llama/Qwen models).

`quantization_config` = {"quant_method": "compressed-tensors", "format": "float-quantized" | "int-quantized"
| "naive-quantized", "config_groups": {name: {"targets": ["Linear" | "re:<regex>" | module name],
"weights": {"num_bits": 8, "type": "float" | "int", "strategy": "channel" | "tensor" | "block",
"symmetric": true, "block_structure": [bn, bk]}, "input_activations": {... "dynamic": true, "strategy":
"token"} | null}}, "ignore": ["lm_head", "re:..."]}. Tensors: `weight`, `weight_scale` (and `input_scale`
for static activations). Supported: 8-bit float weights (channel, tensor, block) and 8-bit symmetric int
weights per channel (weight-only, or W8A8 with dynamic per-token activations).
"""
from __future__ import annotations

import re
from typing import Optional

import torch
from torch import nn

from tokenmill.layers.quantization.base import QuantizationConfig, set_shard_loader
from tokenmill.layers.quantization.fp8 import Fp8LinearMethod
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
        if self.bits != 8 or self.type not in ("float", "int"):
            raise ValueError(f"{what}: {self.bits}-bit {self.type} weights are not supported "
                             "(tokenmill loads 8-bit float and 8-bit int weights)")
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
        from tokenmill.layers.quantization.fp8 import _row_loader

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
        if fmt not in (None, "float-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported "
                             "(float-quantized, int-quantized, naive-quantized)")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ValueError("compressed-tensors checkpoint has no config_groups")
        return cls([_Scheme(n, g) for n, g in groups.items()], list(qc.get("ignore") or []))

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
        if s.type == "int":
            return _Int8CheckpointMethod(activations=s.act_dynamic is not None)
        return Fp8LinearMethod(s.strategy, online=False, block=s.block,
                               static_input_scale=s.act_dynamic is False)

    def describe(self) -> str:
        kinds = sorted({f"{s.type}{s.bits} {s.strategy}" + (" w8a8" if s.type == "int" and s.act_dynamic else "")
                        for s in self.schemes})
        return f"compressed-tensors ({', '.join(kinds)})"
