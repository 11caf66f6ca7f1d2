"""Linear layers. Each owns a quant_method that creates its weights and runs its matmul, so models never
branch on quantization. Column layers shard the output dim across tensor-parallel ranks (and may merge
several logical projections, e.g. q|k|v or gate|up, into one matmul); row layers shard the input dim and
all-reduce their output. Any of them can be built `replicated` (whole weight, no collective) for a model that
keeps some layers unsharded (attention under expert parallelism when the heads do not divide the ranks).

Which slice of the checkpoint a rank holds is one description, `Sharding`, that the weight loaders here and
the quantization formats' scale loaders read. Loaders index the checkpoint tensor (`narrow`), which for the
lazy safetensors slices the model loader hands in reads only those bytes from disk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import tp_all_reduce, tp_rank, tp_size
from tokenmill.layers import cpu_linear


def narrow(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start + size] along dim. `loaded` is a tensor or a lazy checkpoint tensor (models.loader:
    anything with .shape and indexing); indexing the latter reads only the indexed part."""
    index = [slice(None)] * len(loaded.shape)
    index[dim] = slice(start, start + size)
    return loaded[tuple(index)]


def materialize(loaded) -> torch.Tensor:
    """The whole tensor (a replicated parameter, a scalar scale)."""
    return loaded[...]


def split_evenly(size: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """(start, size) of rank's equal part of `size`."""
    if size % tp:
        raise ValueError(f"{what} {size} is not divisible by tensor-parallel size {tp}")
    part = size // tp
    return rank * part, part


@dataclass(frozen=True)
class Sharding:
    """The part of the checkpoint weight [sum(full_sizes), full_in] this rank holds. Logical projection i
    (q, k, v of a merged qkv...) has full_sizes[i] rows in the checkpoint; the rank reads rows
    out_ranges[i] = (start, count) of it into local_sizes[i] rows of its own (count <= local size: a padded
    vocab shard), and columns in_range = (start, count). tp: ranks the layer is split over (1: replicated)."""
    full_in: int
    in_range: tuple[int, int]
    full_sizes: tuple[int, ...]
    out_ranges: tuple[tuple[int, int], ...]
    local_sizes: tuple[int, ...]
    tp: int = 1

    @classmethod
    def replicated(cls, in_features: int, output_sizes: list[int]) -> "Sharding":
        return cls(in_features, (0, in_features), tuple(output_sizes), tuple((0, s) for s in output_sizes),
                   tuple(output_sizes))

    @property
    def in_sharded(self) -> bool:
        return self.in_range[1] < self.full_in

    def local_offset(self, shard: int) -> int:
        return sum(self.local_sizes[:shard])


def _tp(replicated: bool) -> tuple[int, int]:
    return (1, 0) if replicated else (tp_size(), tp_rank())


class UnquantizedLinearMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed_weight = cpu_linear.pack(layer.weight)  # CPU: 16-column panels for the GEMM kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        # F.linear, or the CPU kernels (cpu_linear.py)
        return cpu_linear.linear(x, layer.weight, bias, getattr(layer, "packed_weight", None))


class LinearBase(nn.Module):
    """in_features/out_features are this rank's (local) sizes; `sharding` says where they come from."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_method=None, sharding: Optional[Sharding] = None) -> None:
        super().__init__()
        self.sharding = sharding or Sharding.replicated(in_features, [out_features])
        self.shard_sizes = list(self.sharding.local_sizes)  # what the quantization formats lay scales out by
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def load_shard(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        """Copy this rank's part of checkpoint tensor `loaded` (projection `shard` of a merged layer) into
        param: rows by the shard's range, and for a weight also columns by the input range."""
        if _custom_loader(self, param, loaded, shard):
            return
        s = self.sharding
        expected = (s.full_sizes[shard], s.full_in)[:param.dim()]
        if tuple(loaded.shape) != expected:
            raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not fit a layer expecting {expected}")
        start, rows = s.out_ranges[shard]
        index = [slice(start, start + rows)]
        if param.dim() == 2:
            index.append(slice(s.in_range[0], s.in_range[0] + s.in_range[1]))
        param.data.narrow(0, s.local_offset(shard), rows).copy_(loaded[tuple(index)])


def _custom_loader(layer: LinearBase, param: nn.Parameter, loaded, shard: int) -> bool:
    """Quantized checkpoints' tensors (scales per shard, per block...) bring their own loader, which takes the
    rank's slice by layer.sharding."""
    loader = getattr(param, "shard_loader", None)
    if loader is None:
        return False
    loader(layer, param, loaded, shard)
    return True


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows split evenly across ranks. output_sizes lists merged logical outputs (full
    sizes), each split on its own."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 quant_method=None, replicated: bool = False) -> None:
        tp, rank = _tp(replicated)
        ranges = tuple(split_evenly(s, tp, rank, "output size") for s in output_sizes)
        local = tuple(n for _, n in ranges)
        sharding = Sharding(in_features, (0, in_features), tuple(output_sizes), ranges, local, tp)
        super().__init__(in_features, sum(local), bias, dtype, quant_method, sharding)


def kv_head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) rank attends with: split when tp divides them; with fewer KV heads than ranks
    each is replicated over tp / num_kv_heads ranks (rank r uses head r * num_kv_heads // tp)."""
    if num_kv_heads % tp == 0:
        return split_evenly(num_kv_heads, tp, rank, "KV heads")
    if tp % num_kv_heads == 0:
        return rank * num_kv_heads // tp, 1
    raise ValueError(f"tensor-parallel size {tp} neither divides nor is a multiple of the {num_kv_heads} KV heads")


class QKVParallelLinear(LinearBase):
    """q|k|v in one matmul, sharded by head (an element split would cut heads when KV heads < ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 dtype: torch.dtype, quant_method=None, replicated: bool = False) -> None:
        tp, rank = _tp(replicated)
        q0, nq = split_evenly(num_heads, tp, rank, "attention heads")
        kv0, nkv = kv_head_range(num_kv_heads, tp, rank)
        kv = (kv0 * head_dim, nkv * head_dim)
        sharding = Sharding(hidden_size, (0, hidden_size),
                            (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim),
                            ((q0 * head_dim, nq * head_dim), kv, kv), (nq * head_dim, kv[1], kv[1]), tp)
        super().__init__(hidden_size, (nq + 2 * nkv) * head_dim, bias, dtype, quant_method, sharding)
        self.num_heads, self.num_kv_heads = nq, nkv  # this rank's


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (the input) split across ranks; the partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 quant_method=None, replicated: bool = False) -> None:
        tp, rank = _tp(replicated)
        in_range = split_evenly(in_features, tp, rank, "input size")
        sharding = Sharding(in_features, in_range, (out_features,), ((0, out_features),), (out_features,), tp)
        super().__init__(in_range[1], out_features, bias, dtype, quant_method, sharding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Bias is added once, after the reduction.
        y = self.quant_method.apply(self, x, None)
        if self.sharding.tp > 1:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
