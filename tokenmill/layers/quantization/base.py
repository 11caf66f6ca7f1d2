"""What every quantization format provides: a config that picks a linear method per layer, and the methods.

A QuantizationConfig is either *online* (quantize float weights on load: `--quantization int8|w8a8|fp8|
mxfp4|nvfp4`) or describes a *pre-quantized checkpoint* (read from its `quantization_config`). The loader
installs `config.get_linear_method(layer, name)` as each linear layer's quant_method before the weights load:

- online methods keep the float weight the layer already created and replace it in
  `process_weights_after_loading` (they skip the LM head unless `--quantize-lm-head`; with it, a tied head is
  quantized while the embedding keeps its float copy);
- checkpoint methods create the stored tensors (e.g. fp8 `weight` + `weight_scale`) with per-shard loaders,
  then convert them to the kernel layout after loading.

Either way `apply(layer, x, bias)` runs the layer's matmul from the packed tensors.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from tokenmill.distributed import tp_all_reduce_max
from tokenmill.layers import batch_invariant
from tokenmill.layers.cpu_memory import gather_in_huge_pages
from tokenmill.layers.linear import Sharding, materialize
from tokenmill.layers.quantization import kernels


class QuantizationConfig:
    name = "base"
    online = True  # quantizes float weights on load (False: the checkpoint holds quantized tensors)

    def get_linear_method(self, layer: nn.Module, prefix: str, hf_names: list[str]):
        """A fresh quant method for the linear layer `prefix` (checkpoint module names `hf_names`), or None
        to leave it unquantized."""
        raise NotImplementedError

    def get_moe_method(self, layer: nn.Module):
        """A checkpoint format's quant method for a FusedMoE layer's experts (installed before the weights load),
        or None. Online methods pick theirs in quantization._quantize_experts."""
        return None

    def describe(self) -> str:
        return self.name


def set_shard_loader(param: nn.Parameter, fn: Callable) -> nn.Parameter:
    """Attach fn(layer, param, loaded, shard) as the way linear layers copy this parameter in (see
    linear.LinearBase.load_shard)."""
    param.shard_loader = fn
    return param


def sharding_of(layer) -> Sharding:
    """Which part of the checkpoint's weight the layer holds (linear.Sharding; replicated for a layer that
    does not say)."""
    sharding = getattr(layer, "sharding", None)
    return sharding or Sharding.replicated(layer.in_features, getattr(layer, "shard_sizes", [layer.out_features]))


def per_shard_scalar_loader(layer, param, loaded, shard: int) -> None:
    """One scalar per logical projection of a merged layer (per-tensor scales of q/k/v, gate/up); the same on
    every tensor-parallel rank."""
    param.data[shard] = materialize(loaded).reshape(-1)[0].to(param.dtype)


def full_row_amax(layer, w: torch.Tensor) -> torch.Tensor:
    """Each output row's max |w| over the whole checkpoint row. A row-parallel rank holds part of every row;
    the max over the ranks gives each rank the per-row scales of the unsharded layer, so online quantization
    under tensor parallelism quantizes exactly as one process does."""
    amax = w.float().abs().amax(dim=1)
    if sharding_of(layer).in_sharded:
        tp_all_reduce_max(amax)
    return amax


def full_tensor_amax(layer, w: torch.Tensor) -> torch.Tensor:
    """max |w| over the whole checkpoint tensor (every rank holds a part of it when the layer is sharded)."""
    amax = w.float().abs().amax()
    if sharding_of(layer).tp > 1:
        tp_all_reduce_max(amax)
    return amax


def expand_per_shard(values: torch.Tensor, layer) -> torch.Tensor:
    """[num_shards] -> [N]: each shard's value repeated over its output rows."""
    sizes = getattr(layer, "shard_sizes", [layer.out_features])
    return torch.repeat_interleave(values.float(), torch.tensor(sizes, device=values.device))


class PackedLinearMethod:
    """Runs a linear layer from packed weights through kernels.qlinear. Subclasses fill in:
    layer.weight (int8/uint8 [N, K or K/2]), layer.weight_scale (group scales or None),
    layer.weight_row_scale (float [N] or None), and self.fmt / self.group / self.global_scale."""

    fmt: int = kernels.QFMT_INT8
    group: int = 0
    global_scale: float = 1.0
    run = None  # the bound CPU kernel call (kernels.bind_*), set once the packed tensors are final

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def bind(self, layer: nn.Module) -> None:
        self.run = kernels.bind_qlinear(self.fmt, layer.weight, layer.weight_scale, layer.weight_row_scale,
                                        layer.in_features, self.group, self.global_scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.run is not None and x.is_cpu and (x.numel() <= kernels.FUSED_MAX_ROWS * layer.in_features
                                                  or batch_invariant.enabled()):
            return self.run(x, bias)
        return kernels.qlinear(self.fmt, x, layer.weight, layer.weight_scale, layer.weight_row_scale,
                               layer.in_features, self.group, self.global_scale, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight the packed tensors stand for (tests, the quality report)."""
        return kernels.dequantize(self.fmt, layer.weight, layer.weight_scale, layer.weight_row_scale,
                                  layer.in_features, self.group, self.global_scale)

    def _set(self, layer: nn.Module, weight: torch.Tensor, scale: Optional[torch.Tensor],
             row_scale: Optional[torch.Tensor]) -> None:
        def param(t):
            return None if t is None else nn.Parameter(t.contiguous(), requires_grad=False)

        layer.weight = param(weight)
        layer.weight_scale = param(scale)
        layer.weight_row_scale = param(row_scale)
        if hasattr(layer, "packed_weight"):
            del layer.packed_weight
        self.bind(layer)


def gather_packed_weights(model: nn.Module) -> None:
    """Moves the packed weights of the model's quantized CPU layers into one huge-page buffer (a small model's
    layers are each too small for a huge page of their own) and rebinds their kernels to the new addresses."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), PackedLinearMethod)
              and m.weight.device.type == "cpu"]
    if not layers:
        return
    for m, w in zip(layers, gather_in_huge_pages([m.weight.data for m in layers])):
        m.weight.data = w
        m.quant_method.bind(m)
