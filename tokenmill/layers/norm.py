from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import cpu_fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 then cast back before the weight multiply (as the HF reference does).
    forward(x, residual) fuses the residual add and returns (normed, new_residual)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if cpu_fused.usable(x) and self.weight.dtype == x.dtype:  # one C call instead of ~6 torch ops
            out, new_residual = cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: norm(x) * (1 + w), the product in float32 and cast back once (HF's Gemma3RMSNorm; Llama's
    RMSNorm casts before multiplying). The parameter holds the multiplier 1 + w in float32, added once on load
    (load_shard): a bfloat16 model then rounds only the output, as HF does, and no step pays for the add.
    (llama.cpp's converter stores 1 + w in a GGUF; models/gguf.py takes the 1 off again so every source loads
    the Hugging Face weight.) forward(x, residual) fuses the residual add as RMSNorm's does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)
        self.eps = eps

    def load_shard(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        """loaded: the checkpoint's w (HF convention: the norm multiplies by 1 + w)."""
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(1.0 + loaded[...].float())

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if cpu_fused.usable(x):  # one C call, the same float32 product and rounding as below
            out, new_residual = cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, new_residual)
        if residual is not None:
            x = x + residual
        out = (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * self.weight).to(x.dtype)
        return out if residual is None else (out, x)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (BERT-family encoders), computed in float32 and cast back.
    forward(x, residual) normalizes x + residual (post-norm residual blocks)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if residual is not None:
            x = x + residual
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)
