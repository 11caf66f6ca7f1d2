"""Linear layers. Each owns a quant_method that creates its weights and runs its matmul, so models never
branch on quantization. Column layers shard the output dim across tensor-parallel ranks (and may merge
several logical projections, e.g. q|k|v or gate|up, into one matmul); row layers shard the input dim and
all-reduce their output."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import tp_all_reduce, tp_rank, tp_size
from tokenmill.layers import cpu_linear


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = cpu_linear.pack(layer.weight)  # CPU: 16-column panels for the GEMM kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # F.linear, or the CPU kernels (cpu_linear.py)
        return cpu_linear.linear(x, layer.weight, bias, getattr(layer, "packed_weight", None))


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_method=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not fit a parameter of shape "
                             f"{tuple(param.shape)}")
        param.data.copy_(loaded)


def _custom_loader(layer: LinearBase, param: nn.Parameter, loaded: torch.Tensor, shard: int) -> bool:
    """Quantized checkpoints' tensors (scales per shard, per block...) bring their own loader."""
    loader = getattr(param, "shard_loader", None)
    if loader is None:
        return False
    loader(layer, param, loaded, shard)
    return True


class ReplicatedLinear(LinearBase):
    """The full weight on every rank (the LM head)."""

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if not _custom_loader(self, param, loaded, shard):
            super().load_shard(param, loaded, shard)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows split across ranks. output_sizes lists merged logical outputs (full sizes)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 quant_method=None) -> None:
        tp = tp_size()
        for s in output_sizes:
            if s % tp:
                raise ValueError(f"output size {s} is not divisible by tensor-parallel size {tp}")
        self.shard_sizes = [s // tp for s in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias, dtype, quant_method)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if _custom_loader(self, param, loaded, shard):
            return
        size = self.shard_sizes[shard]
        offset = sum(self.shard_sizes[:shard])
        part = loaded.narrow(0, tp_rank() * size, size)
        param.data.narrow(0, offset, size).copy_(part)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_method=None) -> None:
        tp = tp_size()
        if in_features % tp:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {tp}")
        super().__init__(in_features // tp, out_features, bias, dtype, quant_method)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if _custom_loader(self, param, loaded, shard):
            return
        if param is self.weight:
            loaded = loaded.narrow(1, tp_rank() * self.in_features, self.in_features)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction.
        y = self.quant_method.apply(self, x, None)
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
