import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    if cpu_fused.usable(x):
        return cpu_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
