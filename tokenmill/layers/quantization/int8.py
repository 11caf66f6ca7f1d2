"""INT8 linear weights: symmetric, one scale per output channel (row), values in [-127, 127].

- `int8` (weight-only): decode reads a quarter of the fp32 bytes. Widening every weight to float costs more
  CPU work than the memory it saves, so for decode-sized batches the CPU kernel rounds each activation row to
  a 16-bit integer grid (relative step 2^-15 of the row's max: finer than bf16, far below the int8 weight
  error) and multiplies in integers (16 multiply-adds per AVX2 instruction). Prefill-sized batches widen the
  weights to float once and use MKL with float activations.
- `w8a8`: activations are quantized per token on the fly (dynamic symmetric scales), the products are
  accumulated in int32 (AVX2 `vpmaddwd` on CPU, cuBLAS int8 GEMM through torch._int_mm on CUDA).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import tp_all_reduce_max
from tokenmill.layers import batch_invariant
from tokenmill.layers.quantization import kernels
from tokenmill.layers.quantization.base import PackedLinearMethod, QuantizationConfig, full_row_amax


def quantize_int8(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], float32 scale [N]) with w ~= q * scale[:, None]. amax: each row's max |w|
    to scale by (default w's own; base.full_row_amax under tensor parallelism)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) if amax is None else amax) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


class Int8LinearMethod(PackedLinearMethod):
    fmt = kernels.QFMT_INT8

    def __init__(self, activations: bool) -> None:
        self.activations = activations  # w8a8: quantize activations per token too

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_int8(layer.weight.data, full_row_amax(layer, layer.weight.data))
        self._set(layer, q, None, scale)

    def load_quantized(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        self._set(layer, q.to(torch.int8), None, scale.float().reshape(-1))

    @property
    def act_qmax(self) -> int:
        return kernels.ACT_QMAX_W8A8 if self.activations else kernels.ACT_QMAX_A16

    @property
    def kernel_rows(self) -> float:
        """The most rows `apply` gives the bound kernel outside batch-invariant mode (the CPU decoder stack,
        models/cpu_stack.py, makes the same call and so takes no step with more)."""
        return float("inf") if self.activations else kernels.FUSED_MAX_ROWS

    def bind(self, layer: nn.Module) -> None:
        self.run = kernels.bind_int8(layer.weight, layer.weight_row_scale, self.act_qmax)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        on_grid = self.activations or (x.is_cpu and self.run is not None and
                                       (batch_invariant.enabled() or x.numel() <= self.kernel_rows * layer.in_features))
        if on_grid and getattr(layer, "sharding", None) is not None and layer.sharding.in_sharded:
            return self._apply_row_shard(layer, x, bias)
        if on_grid and self.run is not None and x.is_cpu:
            return self.run(x, bias)
        if self.activations:
            return kernels.int8_linear(x, layer.weight, layer.weight_row_scale, bias, kernels.ACT_QMAX_W8A8)
        # prefill-sized batches (or no C kernel): widen to float once, MKL GEMM with float activations
        return kernels.qlinear(self.fmt, x, layer.weight, None, layer.weight_row_scale, layer.in_features,
                               bias=bias)


    def _apply_row_shard(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """A row-parallel rank holds part of every activation row. The kernels would size each row's grid by
        that part's max, so ranks would round differently from one process; here the grid is the whole row's
        (its max over the ranks), rounded as the kernel rounds, and the integer products summed in float32
        (exact to ~1e-7: the partial sums are all-reduced in float anyway)."""
        x2 = x.reshape(-1, x.shape[-1]).float()
        amax = tp_all_reduce_max(x2.abs().amax(dim=1))
        s = torch.where(amax > 0, amax / self.act_qmax, torch.ones_like(amax))
        q = torch.round(x2 * (1.0 / s)[:, None]).clamp_(-self.act_qmax, self.act_qmax)
        y = (q @ layer.weight.float().t()) * s[:, None] * layer.weight_row_scale.float()[None, :]
        y = y + bias.float() if bias is not None else y
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


class Int8Config(QuantizationConfig):
    online = True

    def __init__(self, activations: bool = False) -> None:
        self.activations = activations
        self.name = "w8a8" if activations else "int8"

    def get_linear_method(self, layer, prefix, hf_names):
        return Int8LinearMethod(self.activations)
