"""FP4 (E2M1) linear weights with block scales, packed two values per byte (low nibble = even index).

The formats (mxfp4: blocks of 32 with an E8M0 scale; nvfp4: blocks of 16 with an E4M3 scale and a tensor
scale) and their arithmetic: fp4_codec.py.

Compute: there is no FP4 arithmetic on CPUs; qlinear.c decodes nibbles with integer bit moves inside the
matmul. On CUDA the weight is widened with torch ops before the matmul (correct, not fast; a fused Triton
kernel would be the next step).
"""
from __future__ import annotations

from torch import nn

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
