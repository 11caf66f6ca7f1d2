"""The FP4 formats' arithmetic in torch (E2M1 codes, nibble packing, mxfp4 and nvfp4 block scales): what
fp4.py quantizes weights with and kernels.py falls back to where the C kernels are missing. Imports nothing
of the quantization package, so that both import it. Two values per byte (low nibble = even index).

E2M1 holds 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (sign bit 3, exponent bits 2-1, mantissa bit 0).
- `mxfp4` (OCP microscaling): blocks of 32 values along K share an E8M0 scale 2^e (one byte, e + 127), with
  the OCP rule e = floor(log2(amax)) - 2: the block's largest value lands in [4, 8) and saturates to 6 above
  6 * 2^e. (Choosing e so that nothing clips, ceil(log2(amax / 6)), measured a slightly larger weight error on
  SmolLM2: coarser steps for every value cost more than clipping the largest.)
- `nvfp4`: blocks of 16 share an FP8 E4M3 scale, times one float32 scale per tensor chosen so the largest
  block scale is 448 (global = amax / (448 * 6)).
Values round to nearest, ties to even, saturating at +-6.
"""
from __future__ import annotations

from typing import Optional

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)  # ties whose upper neighbour has the even mantissa
MX_BLOCK, NV_BLOCK = 32, 16


def e2m1_lut(device=None) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat([pos, -pos])


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float (already divided by its scale) -> uint8 codes 0..15, round to nearest even, saturating."""
    a = v.abs().float().clamp(max=6.0)
    idx = torch.bucketize(a, torch.tensor(_MIDPOINTS, device=v.device))  # a == midpoint -> lower value
    tie_up = torch.zeros_like(a, dtype=torch.bool)
    for t in _TIES_UP:
        tie_up |= a == t
    idx = idx + tie_up.long()
    return (idx | (v < 0).long() << 3).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return e2m1_lut(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def _blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    N, K = w.shape
    if K % block:
        raise ValueError(f"input size {K} is not a multiple of the FP4 block size {block}")
    return w.float().reshape(N, K // block, block)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed uint8 [N, K/2], E8M0 scales uint8 [N, K/32])."""
    b = _blocks(w, MX_BLOCK)
    amax = b.abs().amax(dim=-1)
    _, e = torch.frexp(amax)                  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    e = torch.where(amax > 0, e - 3, torch.full_like(e, -127)).clamp_(-127, 127)
    codes = e2m1_encode(b / torch.ldexp(torch.ones_like(amax), e)[..., None])
    return pack_nibbles(codes.reshape(w.shape)), (e + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    N, K = vals.shape
    s = torch.ldexp(torch.ones(scales.shape, device=scales.device), scales.long() - 127)
    return (vals.reshape(N, K // MX_BLOCK, MX_BLOCK) * s[..., None]).reshape(N, K)


def quantize_nvfp4(w: torch.Tensor, amax: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """[N, K] -> (packed uint8 [N, K/2], E4M3 scales as uint8 [N, K/16], float32 global scale). amax: the
    tensor's max |w| (default w's own; base.full_tensor_amax under tensor parallelism)."""
    b = _blocks(w, NV_BLOCK)
    amax_t = float(amax) if amax is not None else float(b.abs().max()) if b.numel() else 0.0
    global_scale = float(torch.tensor(amax_t / (448.0 * 6.0) if amax_t > 0 else 1.0, dtype=torch.float32))
    block_scale = (b.abs().amax(dim=-1) / 6.0 / global_scale).clamp_(max=448.0).to(torch.float8_e4m3fn)
    eff = block_scale.float() * global_scale
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))
    codes = e2m1_encode(torch.where(eff[..., None] > 0, b / safe[..., None], torch.zeros_like(b)))
    return pack_nibbles(codes.reshape(w.shape)), block_scale.view(torch.uint8), global_scale


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: float) -> torch.Tensor:
    vals = e2m1_decode(unpack_nibbles(packed))
    N, K = vals.shape
    s = scales.view(torch.float8_e4m3fn).float() * torch.tensor(global_scale, dtype=torch.float32)
    return (vals.reshape(N, K // NV_BLOCK, NV_BLOCK) * s[..., None]).reshape(N, K)
