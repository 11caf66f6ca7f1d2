from typing import Callable

import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if cpu_fused.usable(x):
        return cpu_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> gelu_tanh(gate) * up (Gemma's "gelu_pytorch_tanh", which is
    torch's tanh-approximated GELU; llama.cpp's ggml_gelu is the same approximation)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class ClampedSwiGLU:
    """gpt-oss's expert activation over x = [gate | up]: gate clamped above at `limit`, up to [-limit, limit],
    then (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts; its checkpoint interleaves gate
    and up rows, the loader puts them in halves)."""

    def __init__(self, alpha: float, limit: float) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


# HF config activation names (hidden_act, Gemma's hidden_activation) -> the gated activation over [gate | up]
_GATED = {"silu": silu_and_mul, "swish": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


def gated_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _GATED:
        raise ValueError(f"unsupported hidden activation {name!r} for a gated MLP (supported: {', '.join(_GATED)})")
    return _GATED[name]
