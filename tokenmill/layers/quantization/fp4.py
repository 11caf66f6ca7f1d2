"""FP4 (E2M1) linear weights with block scales, packed two values per byte (low nibble = even index).

The formats (mxfp4: blocks of 32 with an E8M0 scale; nvfp4: blocks of 16 with an E4M3 scale and a tensor
scale) and their arithmetic: fp4_codec.py.

Compute: there is no FP4 arithmetic on CPUs; qlinear.c decodes nibbles with integer bit moves inside the
matmul. On CUDA the weight is widened with torch ops before the matmul (correct, not fast; a fused Triton
kernel would be the next step).

MXFP4 checkpoints (config.json `quantization_config.quant_method` "mxfp4", gpt-oss): only the MoE experts are
stored in MXFP4, in exactly this packing (E2M1 pairs low nibble first, an E8M0 byte per 32 along K), so
`Mxfp4MoEMethod` keeps the checkpoint's bytes and runs the same kernels as the linear method; the model's
other layers are float in the checkpoint and stay so.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers import batch_invariant
from tokenmill.layers.quantization import kernels
from tokenmill.layers.quantization.base import PackedLinearMethod, QuantizationConfig, full_tensor_amax
from tokenmill.layers.quantization.fp4_codec import MX_BLOCK, NV_BLOCK, quantize_mxfp4, quantize_nvfp4

class Fp4LinearMethod(PackedLinearMethod):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fmt = kernels.QFMT_MXFP4 if kind == "mxfp4" else kernels.QFMT_NVFP4
        self.group = MX_BLOCK if kind == "mxfp4" else NV_BLOCK

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.kind == "mxfp4":
            packed, scales = quantize_mxfp4(layer.weight.data)
        else:
            packed, scales, self.global_scale = quantize_nvfp4(layer.weight.data,
                                                               full_tensor_amax(layer, layer.weight.data))
        self._set(layer, packed, scales, None)


class Fp4Config(QuantizationConfig):
    online = True

    def __init__(self, kind: str) -> None:
        if kind not in ("mxfp4", "nvfp4"):
            raise ValueError(f"unknown FP4 format {kind!r}")
        self.name = kind

    def get_linear_method(self, layer, prefix, hf_names):
        block = MX_BLOCK if self.name == "mxfp4" else NV_BLOCK
        if layer.in_features % block:
            raise ValueError(f"{self.name} needs input sizes that are multiples of {block}; "
                             f"{prefix} has {layer.in_features}")
        return Fp4LinearMethod(self.name)

    def describe(self) -> str:
        return ("mxfp4 (E2M1 weights, E8M0 scale per 32)" if self.name == "mxfp4"
                else "nvfp4 (E2M1 weights, E4M3 scale per 16 x per-tensor scale)")


class Mxfp4MoEMethod:
    """MoE experts as an MXFP4 checkpoint stores them: w13_weight [E, 2n, H/2] and w2_weight [E, H, n/2] packed
    E2M1 bytes, w13_scale [E, 2n, H/32] and w2_scale [E, H, n/32] E8M0 bytes (n: this rank's width), filled
    row by row by the model's loader (FusedMoE.copy_rows). Decode-sized row counts run the fused qlinear kernel
    per expert (bound once); larger ones widen the expert's weight and use MKL (kernels.qlinear)."""

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        for what, size in (("hidden size", hidden), ("expert intermediate size (per tensor-parallel rank)",
                                                      intermediate)):
            if size % MX_BLOCK:
                raise ValueError(f"MXFP4 experts need a {what} that is a multiple of {MX_BLOCK}; it is {size}")
        u8 = dict(dtype=torch.uint8)
        for name, rows, k in (("w13", 2 * intermediate, hidden), ("w2", hidden, intermediate)):
            setattr(layer, f"{name}_weight", nn.Parameter(torch.empty(num_experts, rows, k // 2, **u8),
                                                          requires_grad=False))
            setattr(layer, f"{name}_scale", nn.Parameter(torch.empty(num_experts, rows, k // MX_BLOCK, **u8),
                                                         requires_grad=False))
        self.runs: dict[str, list] = {}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        for name in ("w13", "w2"):
            w, s = getattr(layer, f"{name}_weight").data, getattr(layer, f"{name}_scale").data
            self.runs[name] = [kernels.bind_qlinear(kernels.QFMT_MXFP4, w[e], s[e], None, 2 * w.shape[2], MX_BLOCK)
                               for e in range(w.shape[0])]

    def load_expert(self, layer, local, proj, weight, rows, cols) -> None:
        raise ValueError("MXFP4 experts load from stacked *_blocks / *_scales checkpoint tensors, not per-expert "
                         "float ones")

    def _linear(self, layer: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        w, s = getattr(layer, f"{name}_weight")[expert], getattr(layer, f"{name}_scale")[expert]
        bias: Optional[torch.Tensor] = layer.expert_bias(name, expert)
        run = self.runs[name][expert] if self.runs else None
        if run is not None and x.is_cpu and (batch_invariant.enabled() or x.shape[0] <= kernels.FUSED_MAX_ROWS):
            return run(x, bias)
        return kernels.qlinear(kernels.QFMT_MXFP4, x, w, s, None, 2 * w.shape[1], MX_BLOCK, bias=bias)

    def apply(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(layer, "w2", expert, layer.act(self._linear(layer, "w13", expert, x)))


class Mxfp4CheckpointConfig(QuantizationConfig):
    """A checkpoint with quantization_config quant_method "mxfp4" (gpt-oss): MXFP4 MoE experts, every linear
    layer float (transformers' Mxfp4 quantizer converts only the experts)."""
    name = "mxfp4"
    online = False

    def get_linear_method(self, layer, prefix, hf_names):
        return None

    def get_moe_method(self, layer: nn.Module):
        return Mxfp4MoEMethod()

    def describe(self) -> str:
        return "mxfp4 checkpoint (MoE experts: E2M1 weights, E8M0 scale per 32, served as stored)"
