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


@pytest.mark.parametrize("M", [9, 64, 600])
def test_packed_onednn_path_matches_f_linear(M):
    g = torch.Generator().manual_seed(M)
    x, w, b = torch.randn(M, 48, generator=g), torch.randn(40, 48, generator=g), torch.randn(40, generator=g)
    packed = cpu_linear.pack(w)
    if packed is None:
        pytest.skip("oneDNN weight packing unavailable in this torch build")
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linear.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
