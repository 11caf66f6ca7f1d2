"""The fused CPU ops (cpu_fused.c) equal the torch code they replace: float32 to rounding, bfloat16 to one
bf16 step; strided rotary inputs (slices of qkv) are rotated in place."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_fused
from tokenmill.layers.rotary import _rotate

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2)}


def _ref_norm(x, residual, w, eps):
    if residual is not None:
        x = x + residual
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return w * normed.to(x.dtype), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 576), (7, 100), (300, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(dtype, T, H, with_residual):
    g = torch.Generator().manual_seed(T * H)
    x, r, w = (torch.randn(*s, generator=g).to(dtype) for s in ((T, H), (T, H), (H,)))
    res = r if with_residual else None
    r_before = r.clone()
    with torch.inference_mode():
        out, new_res = cpu_fused.add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = _ref_norm(x, res, w, 1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    if with_residual:
        assert torch.equal(new_res, ref_res)  # one add, rounded as torch rounds it
    assert torch.equal(r, r_before)  # inputs are never written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 1152), (7, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_norm_float32_weight(dtype, T, H, with_residual):
    """Gemma's (1 + w) RMSNorm: float32 weights, the product in float32 and one rounding (GemmaRMSNorm's torch
    path, HF's Gemma3RMSNorm); the fused call serves float32 and bfloat16 activations."""
    from tokenmill.layers.norm import GemmaRMSNorm

    g = torch.Generator().manual_seed(T + H)
    x, r = (torch.randn(T, H, generator=g).to(dtype) for _ in range(2))
    norm = GemmaRMSNorm(H, 1e-6)
    norm.load_shard(norm.weight, torch.randn(H, generator=g).to(dtype))
    res = r if with_residual else None
    with torch.inference_mode():
        fused = norm(x, res)
        available = cpu_fused.available
        cpu_fused.available = lambda: False  # the torch path
        try:
            ref = norm(x, res)
        finally:
            cpu_fused.available = available
    fused, ref = (fused, ref) if with_residual else ((fused, None), (ref, None))
    assert fused[0].dtype == dtype
    rtol = 2e-6 if dtype == torch.float32 else 2 ** -7  # bf16: at most one rounding step apart
    torch.testing.assert_close(fused[0].float(), ref[0].float(), atol=2e-6, rtol=rtol)
    if with_residual:
        assert torch.equal(fused[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 13), (200, 64)])
def test_silu_and_mul(dtype, T, I):
    x = (torch.randn(T, 2 * I, generator=torch.Generator().manual_seed(I)) * 4).to(dtype)
    with torch.inference_mode():
        out = cpu_fused.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(out.float(), (F.silu(gate) * up).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_qkv_slices(dtype):
    T, Hq, Hk, D, P = 9, 6, 2, 64, 100
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g).to(dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hk, D)
    freqs = torch.arange(P, dtype=torch.float)[:, None] * (1.0 / 10000 ** (torch.arange(0, D, 2) / D))[None]
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.randint(0, P, (T,), generator=g)
    c, s = cos[pos].unsqueeze(1).to(dtype), sin[pos].unsqueeze(1).to(dtype)
    ref_q, ref_k, v_before = _rotate(q, c, s), _rotate(k, c, s), v.clone()
    with torch.inference_mode():
        assert cpu_fused.rope_usable(q, k)
        cpu_fused.rope_(q, pos, cos, sin)
        cpu_fused.rope_(k, pos, cos, sin)
    torch.testing.assert_close(q.float(), ref_q.float(), **TOL[dtype])
    torch.testing.assert_close(k.float(), ref_k.float(), **TOL[dtype])
    assert torch.equal(v, v_before)


def _logits(kind: str, B: int, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, V, generator=g)
    if kind == "ties":  # many equal maxima: the first one wins
        x = torch.randint(0, 3, (B, V), generator=g).float()
    elif kind == "nan":  # the first NaN wins, as in torch
        x[:, V // 2] = float("nan")
        x[:, -1] = float("nan")
    elif kind == "-inf":
        x[:] = float("-inf")
    elif kind == "signed zeros":  # -0 equals +0
        x[:] = -1.0
        x[:, V // 3] = -0.0
        x[:, -1] = 0.0
    return x


@pytest.mark.parametrize("B,V", [(1, 1), (2, 7), (3, 16), (2, 17), (4, 49152), (32, 151936)])
@pytest.mark.parametrize("kind", ["randn", "ties", "nan", "-inf", "signed zeros"])
def test_argmax_equals_torch(B, V, kind):
    """The greedy sampler's argmax: torch's indices for every row, ties, NaN and signed zeros included, across
    the vector chunks and the tail."""
    x = _logits(kind, B, V, torch.Generator().manual_seed(B * V))
    with torch.inference_mode():
        assert torch.equal(cpu_fused.argmax(x), x.argmax(-1))
        assert torch.equal(cpu_fused.argmax(x[:, : max(1, V - 3)]), x[:, : max(1, V - 3)].argmax(-1))  # strided
