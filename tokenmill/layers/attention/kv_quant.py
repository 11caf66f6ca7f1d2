"""Quantized KV cache (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8): per-head scales, quantize on write.

K and V are stored as value / scale in the cache dtype, with one scale per KV head for K and one for V
(shape [2, num_kv_heads], fp32). Attention dequantizes on read; because a head's scale is constant over the
context, the kernels fold it in: scores are multiplied by the K scale, the output by the V scale.

Where the scales come from (the documented default):
- a checkpoint's `self_attn.k_scale` / `self_attn.v_scale` (per tensor or per head), as FP8 checkpoints
  publish them; else
- fp8: 1.0. E4M3 keeps ~2 significant digits over 2^-9..448 and E5M2 over 2^-16..57344, which covers K/V
  activations without scaling (vLLM's default too);
- int8: calibrated on the first step that writes the layer's KV: max |x| per head x 2 / 127, so values up
  to twice the first prompt's range fit before they clip. Calibration happens once; later steps reuse it.

KV received from another instance (disaggregated prefill/decode, kv_transfer/p2p_worker.py) comes quantized
with that instance's scales: an uncalibrated layer adopts them (the bytes are used as they arrived), a layer
calibrated differently requantizes the received values into its own.
"""
from __future__ import annotations

from typing import Optional

import torch

INT8_CALIBRATION_HEADROOM = 2.0


class KVCacheQuant:
    def __init__(self, cache_dtype: torch.dtype, num_kv_heads: int) -> None:
        self.dtype = cache_dtype
        self.scale = torch.ones(2, num_kv_heads, dtype=torch.float32)
        self.calibrated = cache_dtype != torch.int8
        if cache_dtype == torch.int8:
            self.qmax = 127.0
        else:
            self.qmax = float(torch.finfo(cache_dtype).max)
        self._lut: Optional[torch.Tensor] = None

    def to(self, device) -> "KVCacheQuant":
        self.scale = self.scale.to(device)
        return self

    def load_scale(self, which: int, value: torch.Tensor) -> None:
        """A checkpoint's k_scale (which=0) or v_scale (1): a scalar or one per KV head."""
        self.scale[which] = value.detach().float().reshape(-1).to(self.scale.device).expand(self.scale.shape[1])
        self.calibrated = True

    def observe(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Calibrate the int8 scales from the first KV written (k/v: [T, Hkv, D])."""
        if self.calibrated:
            return
        for which, x in ((0, k), (1, v)):
            amax = x.detach().abs().float().amax(dim=(0, 2)).clamp_(min=1e-6)
            self.scale[which] = amax * INT8_CALIBRATION_HEADROOM / self.qmax
        self.calibrated = True

    def adopt(self, scale: torch.Tensor) -> None:
        """Take another instance's scales ([2, Hkv]) as this layer's calibration. In place: kernels and
        captured graphs hold the tensor."""
        self.scale.copy_(scale.to(self.scale.device, torch.float32))
        self.calibrated = True

    def requantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Cache values [..., 2, Hkv, T, D] quantized with `scale` ([2, Hkv], another instance's) -> the same
        values quantized with this layer's scales (dequantize, then quantize, per K/V and head)."""
        theirs = scale.float().to(x.device)[:, :, None, None]
        ours = self.scale.to(x.device)[:, :, None, None]
        y = x.float() * theirs / ours
        if self.dtype == torch.int8:
            y = y.round_()
        return y.clamp_(-self.qmax, self.qmax).to(self.dtype)

    def quantize(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """[T, Hkv, D] -> the cache dtype."""
        y = x.float() / self.scale[which][None, :, None]
        if self.dtype == torch.int8:
            y = y.round_()
        return y.clamp_(-self.qmax, self.qmax).to(self.dtype)

    def dequantize(self, x: torch.Tensor, which: int, dtype: torch.dtype) -> torch.Tensor:
        """Cache values [Hkv, ...] -> dtype."""
        shape = (-1,) + (1,) * (x.dim() - 1)
        return (x.float() * self.scale[which].view(shape)).to(dtype)

    def lut(self) -> torch.Tensor:
        """The fp32 value of each of the 256 byte patterns (for kernels that decode bytes by lookup)."""
        if self._lut is None:
            self._lut = torch.arange(256, dtype=torch.uint8).view(self.dtype).float().contiguous()
        return self._lut
