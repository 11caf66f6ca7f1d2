"""FP8 (E4M3) linear weights.

Online (`--quantization fp8`): one float32 scale per output channel, scale = max|row| / 448.
Pre-quantized checkpoints (the layouts published for Llama/Qwen FP8 models):
- `quantization_config.quant_method == "fp8"`: per-tensor `weight_scale` (vLLM/HF fp8), or block-wise
  `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] when `weight_block_size` is set (Qwen3/DeepSeek FP8);
- `compressed-tensors` float-quantized weights with `weight_scale` per channel [N, 1], per tensor, or per
  block (see compressed_tensors.py). Static `input_scale`s are read but the CPU path keeps activations in
  float (no FP8 arithmetic there); dynamic per-token FP8 activations run on CUDA.

Compute: on Hopper/Ada GPUs per-channel/per-tensor FP8 weights run torch._scaled_mm with activations
quantized per token (row-wise scales); elsewhere the weights are widened on the fly (the CPU kernel in
qlinear.c decodes E4M3 with integer bit moves, fused into the matmul).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from tokenmill.layers.linear import narrow
from tokenmill.layers.quantization import kernels
from tokenmill.layers.quantization.base import (PackedLinearMethod, QuantizationConfig, expand_per_shard,
                                                full_row_amax, per_shard_scalar_loader, set_shard_loader,
                                                sharding_of)

logger = logging.getLogger("tokenmill")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: Optional[tuple[int, int]] = None,
                 amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (float8_e4m3fn [N, K], float32 scale): per output channel ([N]) or, with block=(bn, bk),
    per block ([ceil(N/bn), ceil(K/bk)]); w ~= q * scale. amax: per-channel max |w| to scale by (default w's
    own; base.full_row_amax under tensor parallelism)."""
    w = w.float()
    if block is None:
        scale = (w.abs().amax(dim=1) if amax is None else amax) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    scale = _block_amax(w, block) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / _expand_blocks(scale, block, w.shape)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]] = None) -> torch.Tensor:
    q = q.view(FP8_DTYPE).float() if q.dtype == torch.uint8 else q.float()
    if scale.numel() == 1:
        return q * scale.float().reshape(())
    if block is None:
        return q * scale.float().reshape(-1, 1)
    return q * _expand_blocks(scale.float(), block, q.shape)


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    N, K = w.shape
    gn, gk = -(-N // bn), -(-K // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=w.dtype, device=w.device)
    padded[:N, :K] = w.abs()
    return padded.view(gn, bn, gk, bk).amax(dim=(1, 3))


def _expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape) -> torch.Tensor:
    bn, bk = block
    N, K = shape
    return scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


# -- CUDA: torch._scaled_mm ------------------------------------------------------------------------------
def _scaled_mm_ok(x: torch.Tensor, N: int, K: int) -> bool:
    if x.device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and K % 16 == 0 and N % 16 == 0


def _scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor]):
    """x [.., K] float, w [N, K] fp8 with per-row scales [N]: per-token dynamic fp8 activations, row-wise
    scaled FP8 GEMM with bf16 output."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    x_scale = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=1e-12)
    xq = (x2.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    y = torch._scaled_mm(xq, w_fp8.t(), scale_a=x_scale, scale_b=w_scale.float().reshape(1, -1),
                         bias=bias.to(torch.bfloat16) if bias is not None else None, out_dtype=torch.bfloat16)
    return y.reshape(*x.shape[:-1], w_fp8.shape[0]).to(x.dtype)


# -- the linear method ----------------------------------------------------------------------------------
class Fp8LinearMethod(PackedLinearMethod):
    """strategy: "channel" (online, compressed-tensors channel), "tensor" (one scale per logical projection)
    or "block" (block scales (bn, bk)). online=True quantizes float weights after loading."""

    fmt = kernels.QFMT_FP8

    def __init__(self, strategy: str = "channel", online: bool = True, block: Optional[tuple[int, int]] = None,
                 scale_name: str = "weight_scale", static_input_scale: bool = False) -> None:
        self.strategy, self.online, self.block = strategy, online, block
        self.scale_name = scale_name
        self.static_input_scale = static_input_scale
        self._cuda_ok: Optional[bool] = None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if self.online:
            return super().create_weights(layer, in_features, out_features, dtype)
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        shards = getattr(layer, "shard_sizes", [out_features])
        if self.strategy == "channel":
            scale = nn.Parameter(torch.empty(out_features, 1), requires_grad=False)
            set_shard_loader(scale, _row_loader)
        elif self.strategy == "tensor":
            scale = set_shard_loader(nn.Parameter(torch.empty(len(shards)), requires_grad=False),
                                     per_shard_scalar_loader)
        else:
            bn, bk = self.block
            scale = nn.Parameter(torch.empty(sum(-(-s // bn) for s in shards), -(-in_features // bk)),
                                 requires_grad=False)
            set_shard_loader(scale, _block_loader(bn, bk))
        setattr(layer, self.scale_name, scale)
        if self.static_input_scale:
            layer.input_scale = set_shard_loader(nn.Parameter(torch.empty(len(shards)), requires_grad=False),
                                                 per_shard_scalar_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.online:
            q, scale = quantize_fp8(layer.weight.data, amax=full_row_amax(layer, layer.weight.data))
            self._set(layer, q.view(torch.uint8), None, scale)
            return
        w = layer.weight.data.view(torch.uint8)
        scale = getattr(layer, self.scale_name).data.float()
        delattr(layer, self.scale_name)
        if self.strategy == "channel":
            self._set(layer, w, None, scale.reshape(-1))
        elif self.strategy == "tensor":
            self._set(layer, w, None, expand_per_shard(scale, layer))
        else:  # block rows -> one row of group scales per output row, shard by shard
            bn, bk = self.block
            rows, start = [], 0
            for size in getattr(layer, "shard_sizes", [layer.out_features]):
                nb = -(-size // bn)
                rows.append(scale[start:start + nb].repeat_interleave(bn, 0)[:size])
                start += nb
            self.group = bk
            self._set(layer, w, torch.cat(rows), None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.device.type == "cuda" and layer.weight_row_scale is not None:
            if self._cuda_ok is None:
                self._cuda_ok = _scaled_mm_ok(x, layer.out_features, layer.in_features)
            if self._cuda_ok:
                try:
                    return _scaled_mm(x, layer.weight.view(FP8_DTYPE), layer.weight_row_scale, bias)
                except RuntimeError as e:  # an older torch or an unsupported shape: widen instead, once noted
                    logger.warning("torch._scaled_mm unavailable for this layer (%s); widening fp8 weights", e)
                    self._cuda_ok = False
        return super().apply(layer, x, bias)


def _row_loader(layer, param, loaded, shard: int) -> None:
    """Per-channel scales [N, 1] (or [N]): the rows of the rank's part of projection `shard`."""
    s = sharding_of(layer)
    start, rows = s.out_ranges[shard]
    param.data.narrow(0, s.local_offset(shard), rows).copy_(narrow(loaded, 0, start, rows).reshape(rows, -1))


def _block_loader(bn: int, bk: int):
    """Block scales [ceil(N/bn), ceil(K/bk)]: the blocks covering the rank's rows and columns, which must start
    on a block boundary (each local row/column then keeps its checkpoint block's scale)."""
    def load(layer, param, loaded, shard: int) -> None:
        s = sharding_of(layer)
        (start, rows), (col0, cols) = s.out_ranges[shard], s.in_range
        if start % bn or col0 % bk:
            raise ValueError(f"fp8 block scales of {bn}x{bk} cannot be split at row {start}, column {col0} for "
                             "tensor parallelism; use a tensor-parallel size whose shards start on block bounds")
        n = -(-rows // bn)
        offset = sum(-(-size // bn) for size in s.local_sizes[:shard])
        part = loaded[start // bn:start // bn + n, col0 // bk:col0 // bk + -(-cols // bk)]
        param.data[offset:offset + n].copy_(part)
    return load


class Fp8Config(QuantizationConfig):
    """`--quantization fp8` on a float checkpoint (online), or a checkpoint with quant_method "fp8"."""

    def __init__(self, online: bool = True, block: Optional[tuple[int, int]] = None,
                 static_input_scale: bool = False, ignore: Optional[list[str]] = None) -> None:
        self.name = "fp8"
        self.online, self.block = online, block
        self.static_input_scale = static_input_scale
        self.ignore = set(ignore or [])

    @classmethod
    def from_checkpoint(cls, qc: dict) -> "Fp8Config":
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 checkpoint activation_scheme {scheme!r} is not supported (dynamic or static)")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"fp8 checkpoint weight_block_size {block!r} must be two positive integers")
        ignore = list(qc.get("ignored_layers") or []) + list(qc.get("modules_to_not_convert") or [])
        return cls(online=False, block=tuple(block) if block else None, static_input_scale=scheme == "static",
                   ignore=ignore)

    def get_linear_method(self, layer, prefix, hf_names):
        if self.online:
            return Fp8LinearMethod("channel", online=True)
        if any(n in self.ignore or n.removeprefix("model.") in self.ignore for n in hf_names):
            return None
        if self.block is not None:
            return Fp8LinearMethod("block", online=False, block=self.block, scale_name="weight_scale_inv")
        return Fp8LinearMethod("tensor", online=False, static_input_scale=self.static_input_scale)

    def describe(self) -> str:
        if self.online:
            return "fp8 (E4M3 weights, per-channel scales)"
        return f"fp8 checkpoint ({'block ' + 'x'.join(map(str, self.block)) if self.block else 'per-tensor'} scales)"
