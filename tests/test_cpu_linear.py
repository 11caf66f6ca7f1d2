"""The decode-sized matmul kernel equals F.linear: few rows, odd shapes (K tails, N not a multiple of 4), bias."""
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import cpu_linear

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("N,K", [(64, 32), (7, 13), (33, 100), (3, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_f_linear(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    with torch.inference_mode():
        y = cpu_linear.linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    assert cpu_linear._load() is not None  # the kernel really ran, not the fallback


def test_leading_dims_and_large_batches_fall_back_correctly():
    x, w = torch.randn(2, 3, 16), torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
        big = torch.randn(64, 16)
        torch.testing.assert_close(cpu_linear.linear(big, w), F.linear(big, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,K", [(40, 48), (7, 13), (33, 100)])
def test_panel_path_matches_f_linear(N, K, dtype):
    g = torch.Generator().manual_seed(N * 10 + K)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((70, K), (N, K), (N,)))
    packed = cpu_linear.pack(w)
    assert packed is not None
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    with torch.inference_mode():
        for M in (1, 5, 6, 13, 70):
            y = cpu_linear.linear(x[:M], w, b, packed)
            assert y.dtype == dtype and y.shape == (M, N)
            torch.testing.assert_close(y.float(), F.linear(x[:M].float(), w.float(), b.float()), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_path_rows_are_bit_identical_whatever_the_batch(dtype, monkeypatch):
    """Each output's reduction order depends only on its own row: any subset, any position, same bits."""
    monkeypatch.setenv("TOKENMILL_MATMUL", "panel")  # the panel kernel for every row count, whatever is measured
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((100, 96), (50, 96), (50,)))
    packed = cpu_linear.pack(w)
    with torch.inference_mode():
        full = cpu_linear.linear(x, w, b, packed)
        for lo, hi in ((0, 1), (3, 4), (5, 12), (7, 55), (49, 100)):
            assert torch.equal(cpu_linear.linear(x[lo:hi], w, b, packed), full[lo:hi])
