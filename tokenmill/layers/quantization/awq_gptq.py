"""int4 checkpoints: AWQ, GPTQ and compressed-tensors `pack-quantized`, loaded as ggml Q4_1 blocks (int4.py).

Each format stores, per output row n and input column k, a 4-bit q, and per group of g input columns a scale
and a zero point, standing for w = scale * (q - zero). The layouts (K inputs, N outputs, int32 words holding 8
nibbles, nibble i at bits 4i):
- AWQ (`quant_method: awq`, version gemm): qweight int32 [K, N/8] packed along N in AWQ's interleaved order
  (nibble i holds column AWQ_ORDER[i] of its 8), qzeros int32 [K/g, N/8] likewise, scales fp16 [K/g, N].
- GPTQ (`quant_method: gptq`): qweight int32 [K/8, N] packed along K, qzeros int32 [K/g, N/8] packed along N
  holding zero - 1 (the historical offset of checkpoint_format "gptq": the zero is the nibble + 1, 1..16, as
  the exllama/vLLM kernels read it; "gptq_v2" stores the zero itself; a symmetric checkpoint's zeros are 8), scales fp16 [K/g, N], g_idx int32 [K] (the group of each column: only
  the contiguous k // g is supported; act-order checkpoints whose g_idx reorders groups are refused).
- compressed-tensors `pack-quantized` (4-bit int, strategy group or channel): weight_packed int32 [N, K/8]
  packed along K, weight_scale [N, K/g], weight_shape [2]; asymmetric ones add weight_zero_point int32
  [ceil(N/8), K/g] packed along N. Values and zero points are signed and stored offset by 8, so the unsigned
  nibbles are q and zero directly (symmetric: zero 8).

Loading unpacks exactly to q, scale and zero (per 32-value block) and repacks them as Q4_1: d = fp16(scale),
m = fp16(-scale * zero), since scale * (q - zero) = d * q + m. The one inexact step is the fp16 rounding of m
(and of d where the checkpoint's scales are not fp16): at most 2^-11 of |scale * zero| (2^-25 absolute where m
falls below fp16's normal range), i.e. under 1% of one quantization step for zeros up to 15.

Tensor parallelism: each rank reads only the int32 words and groups covering its rows and columns and unpacks
those; a row-parallel split must fall on the 32-value bounds of the Q4_1 blocks (not necessarily on group
bounds: each block keeps its own group's scale and zero).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.layers.linear import materialize
from tokenmill.layers.quantization.base import QuantizationConfig, set_shard_loader, sharding_of
from tokenmill.layers.quantization.int4 import BLOCK, Q4BlockMethod, check_input_split, pack_q4_1

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
SEQ_ORDER = tuple(range(8))


def _span(start: int, count: int, unit: int) -> tuple[int, int, int]:
    """Logical range [start, start + count) over stored entries of `unit` logical items each: (first stored
    index, stored count, offset of start in the first one)."""
    first = start // unit
    return first, -(-(start + count) // unit) - first, start - first * unit


def unpack_nibbles(t: torch.Tensor, axis: int, order: tuple[int, ...] = SEQ_ORDER) -> torch.Tensor:
    """int32 words -> uint8 nibbles, `axis` 8x longer: element 8w + order[i] is nibble i of word w."""
    shifts = torch.tensor([4 * order.index(j) for j in range(8)], dtype=torch.int32)
    t = t.to(torch.int32).movedim(axis, -1)
    q = ((t[..., None] >> shifts) & 0xF).to(torch.uint8).reshape(*t.shape[:-1], t.shape[-1] * 8)
    return q.movedim(-1, axis)


@dataclass(frozen=True)
class Field:
    """One checkpoint tensor of a format and the part of (q, scale, zero) it holds. n_axis: the stored axis
    over the output rows (the other runs over the input columns); n_pack / k_pack: 8 nibbles per int32 along
    that logical axis; grouped: one entry per group of input columns; offset: added to the unpacked values."""
    name: str
    role: str  # "q", "scale" or "zero"
    n_axis: int
    n_pack: bool = False
    k_pack: bool = False
    grouped: bool = False
    order: tuple[int, ...] = SEQ_ORDER
    offset: int = 0

    def read(self, loaded, N: int, K: int, g: int, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """This rank's [rows, cols] of the field over an [N, K] projection, oriented [n, k]: q per value,
        scale and zero per 32-value block."""
        n_unit = 8 if self.n_pack else 1
        k_unit, k_total = (g // BLOCK, K // BLOCK) if self.grouped else (8 if self.k_pack else 1, K)
        k0, kk = (cols[0] // BLOCK, cols[1] // BLOCK) if self.grouped else cols
        stored = (-(-N // n_unit), k_total // k_unit)
        stored = stored if self.n_axis == 0 else stored[::-1]
        if tuple(loaded.shape) != stored:
            raise ValueError(f"{self.name} of shape {tuple(loaded.shape)} does not fit a {N}x{K} int4 layer with "
                             f"groups of {g} (expected {stored})")
        (ns, nc, noff), (ks, kc, koff) = _span(rows[0], rows[1], n_unit), _span(k0, kk, k_unit)
        index = (slice(ns, ns + nc), slice(ks, ks + kc))
        t = loaded[index if self.n_axis == 0 else index[::-1]]
        t = t.t() if self.n_axis == 1 else t
        if self.n_pack:
            t = unpack_nibbles(t, 0, self.order)
        if self.k_pack:
            t = unpack_nibbles(t, 1, self.order)
        elif self.grouped:
            t = t.repeat_interleave(k_unit, dim=1)
        t = t[noff:noff + rows[1], koff:koff + kk]
        return t.float() + self.offset if self.role != "q" else t


@dataclass(frozen=True)
class Layout:
    """A format's tensors. zero: the constant zero point where no field holds one (symmetric formats)."""
    name: str
    fields: tuple[Field, ...]
    zero: Optional[int] = None


def awq_layout() -> Layout:
    return Layout("awq", (Field("qweight", "q", 1, n_pack=True, order=AWQ_ORDER),
                          Field("qzeros", "zero", 1, n_pack=True, grouped=True, order=AWQ_ORDER),
                          Field("scales", "scale", 1, grouped=True)))


def gptq_layout(v2: bool) -> Layout:
    return Layout("gptq", (Field("qweight", "q", 1, k_pack=True),
                           Field("qzeros", "zero", 1, n_pack=True, grouped=True, offset=0 if v2 else 1),
                           Field("scales", "scale", 1, grouped=True)))


def pack_quantized_layout(symmetric: bool) -> Layout:
    fields = (Field("weight_packed", "q", 0, k_pack=True), Field("weight_scale", "scale", 0, grouped=True))
    if symmetric:
        return Layout("compressed-tensors", fields, zero=8)
    return Layout("compressed-tensors", fields + (Field("weight_zero_point", "zero", 0, n_pack=True, grouped=True),))


def blocks_from_groups(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, k], scale and zero per 32-value block [n, k/32] -> Q4_1 blocks standing for
    scale * (q - zero): d = fp16(scale), m = fp16(-scale * zero) (the module docstring bounds the rounding)."""
    scale = scale.float()
    return pack_q4_1(q, scale, -scale * zero.float())


class CheckpointInt4Method(Q4BlockMethod):
    """A linear layer of an int4 checkpoint: each projection's tensors are read into (q, scale, zero) as they
    arrive, packed into Q4_1 blocks once all three are there, and the blocks of all projections installed after
    loading. group: the checkpoint's group size (-1: one group per row); what: the layer, for errors."""

    def __init__(self, layout: Layout, group: int, what: str, check_g_idx: bool = False) -> None:
        super().__init__()
        self.layout, self.group, self.what, self.check_g_idx = layout, group, what, check_g_idx
        self.pending: list[dict[str, torch.Tensor]] = []
        self.blocks: list[Optional[torch.Tensor]] = []

    def _group(self, layer: nn.Module) -> int:
        return self.group if self.group > 0 else sharding_of(layer).full_in

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        s, g, what = sharding_of(layer), self._group(layer), f"{self.layout.name} layer {self.what}"
        if s.full_in % g:
            raise ValueError(f"{what}: group size {g} does not divide its input size {s.full_in}")
        check_input_split(layer, what)
        self.pending, self.blocks = [{} for _ in s.local_sizes], [None] * len(s.local_sizes)
        for field in self.layout.fields:
            self._placeholder(layer, field.name, self._field_loader(field))
        if self.check_g_idx:
            self._placeholder(layer, "g_idx", self._check_g_idx)
        if self.layout.name == "compressed-tensors":
            self._placeholder(layer, "weight_shape", self._check_shape)

    @staticmethod
    def _placeholder(layer: nn.Module, name: str, loader) -> None:
        # an empty parameter, so the loader finds the tensor's place; its loader keeps what this rank needs
        setattr(layer, name, set_shard_loader(nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False),
                                              loader))

    def _field_loader(self, field: Field):
        def load(layer, param, loaded, shard: int) -> None:
            s = sharding_of(layer)
            try:
                t = field.read(loaded, s.full_sizes[shard], s.full_in, self._group(layer), s.out_ranges[shard],
                               s.in_range)
            except ValueError as e:
                raise ValueError(f"{self.layout.name} layer {self.what}: {e}") from None
            self.pending[shard][field.role] = t
            self._pack_if_ready(layer, shard)
        return load

    def _pack_if_ready(self, layer: nn.Module, shard: int) -> None:
        got = self.pending[shard]
        if self.layout.zero is not None and "q" in got:
            got.setdefault("zero", torch.full((got["q"].shape[0], got["q"].shape[1] // BLOCK),
                                              float(self.layout.zero)))
        if not {"q", "scale", "zero"} <= got.keys():
            return
        blocks = blocks_from_groups(got["q"], got["scale"], got["zero"])
        pad = sharding_of(layer).local_sizes[shard] - blocks.shape[0]  # a padded vocabulary shard: zero rows
        self.blocks[shard] = torch.cat([blocks, blocks.new_zeros(pad, blocks.shape[1])]) if pad else blocks
        self.pending[shard] = {}

    def _check_g_idx(self, layer, param, loaded, shard: int) -> None:
        K, g = sharding_of(layer).full_in, self._group(layer)
        g_idx = materialize(loaded).reshape(-1)
        if g_idx.numel() != K or not torch.equal(g_idx.long(), torch.arange(K) // g):
            raise ValueError(f"gptq layer {self.what}: its g_idx reorders the groups (desc_act / act-order), "
                             "which tokenmill does not load; use a checkpoint quantized with desc_act=false")

    def _check_shape(self, layer, param, loaded, shard: int) -> None:
        s = sharding_of(layer)
        shape = tuple(int(v) for v in materialize(loaded).reshape(-1))
        if shape != (s.full_sizes[shard], s.full_in):
            raise ValueError(f"compressed-tensors layer {self.what}: weight_shape {shape} does not fit a layer "
                             f"expecting {(s.full_sizes[shard], s.full_in)}")

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if any(b is None for b in self.blocks):
            raise ValueError(f"{self.layout.name} layer {self.what}: a projection is missing some of its tensors")
        for name in [f.name for f in self.layout.fields] + ["g_idx", "weight_shape"]:
            if name in layer._parameters:
                delattr(layer, name)
        blocks, self.blocks = torch.cat(self.blocks), []
        self._install(layer, blocks)


def _check_group(method: str, group: int) -> int:
    if group != -1 and (group < BLOCK or group % BLOCK):
        raise ValueError(f"{method} group_size {group} is not supported: int4 runs as Q4_1 blocks of {BLOCK} "
                         f"values, so groups must be multiples of {BLOCK} (32, 64, 128...) or -1 (per row)")
    return group


def _check_bits(method: str, bits) -> None:
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits}-bit weights are not supported (4-bit only)")


class AwqConfig(QuantizationConfig):
    """`quant_method: awq` (AutoAWQ's GEMM layout). The LM head and modules_to_not_convert stay float."""
    name = "awq"
    online = False

    def __init__(self, group: int, skip: list[str]) -> None:
        self.group, self.skip = group, skip

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "AwqConfig":
        _check_bits("awq", qc.get("bits", qc.get("w_bit")))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq version {version!r} is not supported (the gemm layout loads)")
        if qc.get("zero_point", True) is False:
            raise ValueError("awq checkpoints without zero points are not supported")
        group = _check_group("awq", int(qc.get("group_size", qc.get("q_group_size", 128))))
        return cls(group, list(qc.get("modules_to_not_convert") or []))

    def get_linear_method(self, layer, prefix, hf_names):
        if any(n.startswith("lm_head") or any(s in n for s in self.skip) for n in hf_names):
            return None
        return CheckpointInt4Method(awq_layout(), self.group, prefix)

    def describe(self) -> str:
        return f"awq (int4, groups of {self.group}, as ggml Q4_1 blocks)"


class GptqConfig(QuantizationConfig):
    """`quant_method: gptq` (AutoGPTQ / GPTQModel / optimum). The LM head stays float unless `lm_head: true`."""
    name = "gptq"
    online = False

    def __init__(self, group: int, v2: bool, lm_head: bool) -> None:
        self.group, self.v2, self.lm_head = group, v2, lm_head

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "GptqConfig":
        _check_bits("gptq", qc.get("bits"))
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
        group = _check_group("gptq", int(qc.get("group_size", 128)))
        return cls(group, fmt == "gptq_v2", bool(qc.get("lm_head", False)))

    def get_linear_method(self, layer, prefix, hf_names):
        if any(n.startswith("lm_head") for n in hf_names) and not self.lm_head:
            return None
        return CheckpointInt4Method(gptq_layout(self.v2), self.group, prefix, check_g_idx=True)

    def describe(self) -> str:
        return f"gptq (int4, groups of {self.group if self.group > 0 else 'a row'}, as ggml Q4_1 blocks)"


def pack_quantized_method(spec: dict, prefix: str) -> CheckpointInt4Method:
    """The method for a compressed-tensors `pack-quantized` 4-bit int scheme (its `weights` dict)."""
    strategy = spec.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors int4 weight strategy {strategy!r} is not supported (group, channel)")
    if spec.get("actorder") in ("group", True):
        raise ValueError("compressed-tensors int4 with actorder 'group' (a weight_g_idx reordering the groups) "
                         "is not supported")
    group = _check_group("compressed-tensors", int(spec.get("group_size") or 0) if strategy == "group" else -1)
    return CheckpointInt4Method(pack_quantized_layout(spec.get("symmetric", True) is not False), group, prefix)
