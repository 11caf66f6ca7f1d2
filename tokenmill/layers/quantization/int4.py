"""int4 weights (`--quantization int4`, and the AWQ / GPTQ / compressed-tensors checkpoints of awq_gptq.py) as
ggml Q4_1 blocks, run by the same block kernels as a GGUF (quantization/ggml.py).

A Q4_1 block holds 32 consecutive input values of one output row: fp16 `d`, fp16 `m` and 16 bytes of nibbles
(byte j: value j in the low nibble, value j + 16 in the high one), standing for w = d * q + m, q in 0..15.
That is asymmetric int4 with a group of 32, so one layout serves every int4 format here: a layer's weight is a
uint8 tensor [N, K / 32 * 20] (one ggml Part of all its merged projections' rows) and its matmul is
`ggml.bind(parts, K)(x, bias)`; the one-call CPU decoder stack runs the same bound object (`block_linear`).

Online (`--quantization int4`, weight-only): per group of 32 (or 128 with `int4-g128`, its d and m repeated
in each of its four blocks) d = (max - min) / 15 and m = min, both rounded to fp16 first, then
q = round((w - m) / d) clamped to 0..15 against those rounded values, so the blocks stand for the nearest
grid point of the grid they store. Each rank quantizes its own slice: blocks never straddle ranks (the input
split must fall on 32-value bounds), so tensor parallelism quantizes exactly as one process does. MoE experts
(Int4MoEMethod) are quantized the same way, each expert's gate|up and down one bound block linear, where the
rank's expert sizes are multiples of the group; otherwise they stay in the model dtype, said once.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers.fused_moe import UnquantizedMoEMethod
from tokenmill.layers.quantization import ggml
from tokenmill.layers.quantization.base import QuantizationConfig, sharding_of

Q4_1 = 3          # ggml's type id
BLOCK = 32        # values per Q4_1 block
BLOCK_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
ONLINE_GROUPS = {"int4": 32, "int4-g128": 128}


def pack_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (0..15), d and m [N, K / 32] (rounded to fp16 here) -> Q4_1 blocks uint8 [N, K/32*20]."""
    N, K = q.shape
    nb = K // BLOCK
    q = q.reshape(N, nb, 2, BLOCK // 2).to(torch.uint8)
    nibbles = q[:, :, 0] | (q[:, :, 1] << 4)  # byte j: value j low, value j + 16 high
    dm = torch.stack([d.to(torch.float16), m.to(torch.float16)], dim=-1).reshape(N, nb, 2).view(torch.uint8)
    return torch.cat([dm.reshape(N, nb, 4), nibbles], dim=-1).reshape(N, nb * BLOCK_BYTES).contiguous()


def unpack_q4_1(blocks: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_q4_1: (q uint8 [N, K], d float16 [N, K/32], m float16 [N, K/32])."""
    N, nb = blocks.shape[0], K // BLOCK
    b = blocks[:, :nb * BLOCK_BYTES].reshape(N, nb, BLOCK_BYTES)
    dm = b[:, :, :4].contiguous().view(torch.float16)
    q = torch.stack([b[:, :, 4:] & 0xF, b[:, :, 4:] >> 4], dim=2).reshape(N, K)
    return q, dm[:, :, 0], dm[:, :, 1]


def dequantize_q4_1(blocks: torch.Tensor, K: int) -> torch.Tensor:
    """float32 [N, K] of Q4_1 blocks, computed as ggml does (d * q + m in float32)."""
    q, d, m = unpack_q4_1(blocks, K)
    N = q.shape[0]
    return (q.float().reshape(N, -1, BLOCK) * d.float()[..., None] + m.float()[..., None]).reshape(N, K)


def quantize_q4_1(w: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """float [N, K] -> Q4_1 blocks: per `group` values (a multiple of 32) d = (max - min) / 15, m = min in
    fp16, q = round((w - m) / d) against the fp16 values (a constant group: d = 0, q = 0, w = m)."""
    N, K = w.shape
    g = w.float().reshape(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
    inv = torch.where(d > 0, 1.0 / d.float(), torch.zeros_like(lo))
    q = torch.round((g - m.float()[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8).reshape(N, K)
    reps = group // BLOCK
    return pack_q4_1(q, d.repeat_interleave(reps, dim=1), m.repeat_interleave(reps, dim=1))


def check_input_split(layer: nn.Module, what: str) -> None:
    """Q4_1 blocks are 32 input values: the layer's input size and a row-parallel rank's columns must fall
    on those bounds."""
    s = sharding_of(layer)
    start, count = s.in_range
    if s.full_in % BLOCK:
        raise ValueError(f"{what}: the input size {s.full_in} is not a multiple of {BLOCK} (int4 runs as ggml "
                         f"Q4_1 blocks of {BLOCK} values)")
    if start % BLOCK or count % BLOCK:
        raise ValueError(f"{what}: the tensor-parallel split gives this rank input columns {start}..{start + count}, "
                         f"which cut the {BLOCK}-value int4 blocks; use a tensor-parallel size that divides "
                         f"{s.full_in // BLOCK} blocks evenly")


class Q4BlockMethod:
    """A linear layer whose weight is Q4_1 blocks (uint8 [N, K/32*20], `layer.weight`), run by the ggml block
    kernels. Subclasses make the blocks and call _install."""

    def __init__(self) -> None:
        self.block_linear: Optional[ggml.BlockLinear] = None  # bound once the blocks are final

    def _install(self, layer: nn.Module, blocks: torch.Tensor) -> None:
        if blocks.device.type != "cpu":
            raise ValueError("int4 weights (ggml Q4_1 blocks) run on the CPU block kernels only; use --device cpu, "
                             "or int8/fp8 on CUDA")
        if hasattr(layer, "packed_weight"):
            del layer.packed_weight
        self.block_linear = ggml.bind([ggml.Part(Q4_1, blocks.contiguous())], layer.in_features)
        # the blocks the kernel runs (Q4_1, or their x8 repack): the layer's weight, and nothing else kept
        layer.weight = nn.Parameter(self.block_linear.parts[0].data, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.block_linear(x, bias)

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight the blocks stand for (tests, the quality report)."""
        return ggml.dequantize(self.block_linear.parts[0], layer.in_features)


class Int4LinearMethod(Q4BlockMethod):
    """`--quantization int4`: the float weight loads as usual and becomes Q4_1 blocks after loading."""

    def __init__(self, group: int = BLOCK) -> None:
        super().__init__()
        self.group = group

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_input_split(layer, "--quantization int4")
        if layer.in_features % self.group or sharding_of(layer).in_range[0] % self.group:
            raise ValueError(f"--quantization int4: groups of {self.group} do not divide this rank's input "
                             f"columns {sharding_of(layer).in_range}; use int4 (groups of {BLOCK})")
        self._install(layer, quantize_q4_1(layer.weight.data, self.group))


class Int4Config(QuantizationConfig):
    online = True

    def __init__(self, name: str = "int4") -> None:
        self.name, self.group = name, ONLINE_GROUPS[name]

    def get_linear_method(self, layer, prefix, hf_names):
        return Int4LinearMethod(self.group)

    def describe(self) -> str:
        return f"{self.name} (weight-only, asymmetric, groups of {self.group}, as ggml Q4_1 blocks)"


class Int4MoEMethod(UnquantizedMoEMethod):
    """`--quantization int4` on MoE experts (layers/fused_moe.FusedMoE): the float expert weights load as usual;
    afterwards each expert's gate|up [2n, H] and down [H, n] become Q4_1 blocks (stacked, [E, rows, bytes])
    with one bound block linear each."""

    def __init__(self, group: int = BLOCK) -> None:
        self.group = group
        self.w13: list[ggml.BlockLinear] = []
        self.w2: list[ggml.BlockLinear] = []

    @staticmethod
    def fits(layer: nn.Module, group: int) -> bool:
        """Whether the rank's expert sizes (hidden, and its part of the intermediate size) are whole groups."""
        return layer.hidden_size % group == 0 and layer.intermediate_size % group == 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        runs = {}
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data
            blocks = torch.stack([quantize_q4_1(w[e], self.group) for e in range(w.shape[0])])
            setattr(layer, f"{name}_weight", nn.Parameter(blocks, requires_grad=False))
            # per-row kernel: an x8 copy per expert would double the stacked blocks' memory
            runs[name] = [ggml.bind([ggml.Part(Q4_1, b)], w.shape[2], repack=False) for b in blocks]
        self.w13, self.w2 = runs["w13"], runs["w2"]

    def apply(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        h = self.w13[expert](x, layer.expert_bias("w13", expert))
        return self.w2[expert](layer.act(h), layer.expert_bias("w2", expert))
