"""The attention backend over the paged cache against a dense reference: the C kernel path and the pure-torch
path, GQA/MQA, sliding windows, mixed decode + prefill steps, scattered block tables, fp32 and bf16."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from tokenmill.layers.attention import cpu_kernels, triton_paged
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu import PagedAttentionBackend


def _reference(q, k_all, v_all, positions, ctx_starts, window, scale, sinks=None):
    """Dense attention for each query token over its request's keys (k_all/v_all: [S, Hkv, D]); sinks [Hq]: a
    logit per head in the softmax's denominator, with no value."""
    out = []
    Hq, Hkv = q.shape[1], k_all[0].shape[1]
    for t in range(q.shape[0]):
        ks, vs = k_all[t], v_all[t]
        p = positions[t]
        lo = 0 if window is None else max(0, p + 1 - window)
        kk = ks[lo:p + 1].float().repeat_interleave(Hq // Hkv, dim=1)    # [L, Hq, D]
        vv = vs[lo:p + 1].float().repeat_interleave(Hq // Hkv, dim=1)
        w = torch.einsum("hd,lhd->hl", q[t].float(), kk) * scale
        if sinks is not None:
            w = torch.cat([w, sinks.float()[:, None]], dim=1).softmax(-1)[:, :-1]
        else:
            w = w.softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", w, vv))
    return torch.stack(out)


def _run_step(backend, dtype, Hq, Hkv, window, query_lens, ctx_lens, bs=4, D=32, seed=0, device="cpu",
              sinks=None):
    """One step: request i has ctx_lens[i] tokens already cached and computes query_lens[i] new ones."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.RandomState(seed)
    B = len(query_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, query_lens)]
    nbs = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(nbs) + 3
    perm = rng.permutation(num_blocks)  # scattered, non-monotonic blocks
    block_table = np.zeros((B, max(nbs)), dtype=np.int64)
    c = 0
    for i, nb in enumerate(nbs):
        block_table[i, :nb] = perm[c:c + nb]
        c += nb
    kv = torch.zeros(2, Hkv, num_blocks, bs, D, dtype=dtype)
    full_k = [torch.randn(s, Hkv, D, generator=g).to(dtype) for s in seq_lens]
    full_v = [torch.randn(s, Hkv, D, generator=g).to(dtype) for s in seq_lens]
    for i in range(B):  # the cached context
        for p in range(ctx_lens[i]):
            blk, off = block_table[i, p // bs], p % bs
            kv[0, :, blk, off], kv[1, :, blk, off] = full_k[i][p], full_v[i][p]
    q_list, k_new, v_new, positions, slots, per_tok_k, per_tok_v = [], [], [], [], [], [], []
    for i in range(B):
        for p in range(ctx_lens[i], seq_lens[i]):
            q_list.append(torch.randn(Hq, D, generator=g).to(dtype))
            k_new.append(full_k[i][p])
            v_new.append(full_v[i][p])
            positions.append(p)
            slots.append(block_table[i, p // bs] * bs + p % bs)
            per_tok_k.append(full_k[i])
            per_tok_v.append(full_v[i])
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    dev = torch.device(device)
    meta = AttentionMetadata(positions=torch.tensor(positions, device=dev),
                             slot_mapping=torch.tensor(slots, device=dev),
                             block_table=torch.from_numpy(block_table).to(dev), query_start_loc=qsl,
                             seq_lens=seq_lens, block_size=bs)
    q = torch.stack(q_list)
    scale = D ** -0.5
    out = backend.forward(q.to(dev), torch.stack(k_new).to(dev), torch.stack(v_new).to(dev), kv.to(dev), meta,
                          scale, window, sinks=None if sinks is None else sinks.to(dev))
    ref = _reference(q, per_tok_k, per_tok_v, positions, None, window, scale, sinks)
    return out.cpu(), ref


def _backends():
    out = [pytest.param(PagedAttentionBackend("cpu", use_kernel=False), id="torch")]
    if shutil.which("cc") or shutil.which("gcc"):
        out.append(pytest.param(PagedAttentionBackend("cpu"), id="kernel"))
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("Hq,Hkv,window", [(4, 4, None), (8, 2, None), (6, 1, None), (8, 2, 5)])
def test_backend_matches_dense_reference(backend, dtype, tol, Hq, Hkv, window):
    # decodes of very different context lengths, a fresh prompt, a continued chunk, a 1-token prefill
    query_lens = [1, 1, 7, 1, 5, 1]
    ctx_lens = [0, 13, 0, 30, 9, 2]
    out, ref = _run_step(backend, dtype, Hq, Hkv, window, query_lens, ctx_lens)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


SINK_CASES = [(4, 4, None), (8, 2, None), (8, 2, 5)]


def _sinks(Hq: int) -> torch.Tensor:
    """Sinks from well below to well above the scores (|score| ~ 1 here), so they visibly take weight."""
    return torch.linspace(-3.0, 4.0, Hq)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("Hq,Hkv,window", SINK_CASES)
def test_sinks_match_dense_reference(backend, dtype, tol, Hq, Hkv, window):
    """Attention sinks (gpt-oss) through the kernel (decodes, short chunks) and the torch paths (prefills, and
    everything without the kernel): the dense reference with the sink in each softmax."""
    query_lens, ctx_lens = [1, 1, 7, 1, 20, 1], [0, 13, 0, 30, 9, 2]
    out, ref = _run_step(backend, dtype, Hq, Hkv, window, query_lens, ctx_lens, sinks=_sinks(Hq))
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    plain, _ = _run_step(backend, dtype, Hq, Hkv, window, query_lens, ctx_lens)
    assert (plain.float() - ref).abs().max() > 0.05  # the sinks change the output


def test_kernel_is_used_on_cpu_when_a_compiler_exists():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    assert cpu_kernels.load() is not None
    assert PagedAttentionBackend("cpu").name == "cpu_paged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D,window", [(9, 3, 64, None), (14, 2, 64, None), (5, 5, 128, None),
                                             (6, 1, 128, 21), (8, 1, 64, 21)])
def test_all_decode_step_kernel_equals_torch_path(dtype, Hq, Hkv, D, window):
    """The kernel's specialised head sizes (64, 128) on 16-token blocks: keys scored eight at a time and the
    rest one by one (contexts of 1-100 tokens, windows that start mid-block), values summed for 1-4 query heads
    at a time (query heads per KV head 1, 3, 5, 6, 7, 8)."""
    if not cpu_kernels.supports(dtype):
        pytest.skip("no C compiler")
    torch_path = PagedAttentionBackend("cpu", use_kernel=False)
    lens = [1, 17, 64, 33, 100]
    args = (dtype, Hq, Hkv, window, [1] * 5, [n - 1 for n in lens])
    a, ref = _run_step(PagedAttentionBackend("cpu"), *args, bs=16, D=D)
    b, _ = _run_step(torch_path, *args, bs=16, D=D)
    torch.testing.assert_close(a.float(), ref, atol=3e-2, rtol=3e-2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def _triton_check():
    """Run under TRITON_INTERPRET=1: the Triton kernel, driving the backend's decode path on CPU tensors."""
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]:
        for Hq, Hkv, window in [(4, 4, None), (8, 2, None), (6, 1, None), (9, 3, 5)]:
            backend = PagedAttentionBackend("cpu", use_kernel=False)
            backend.kernel, backend.kernel_dtypes = triton_paged.paged_attention, (dtype,)
            out, ref = _run_step(backend, dtype, Hq, Hkv, window, [1, 1, 7, 1, 5, 1], [0, 13, 0, 30, 9, 2],
                                 D=24)  # D not a power of two: the kernel pads and masks it
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        for Hq, Hkv, window in SINK_CASES:
            backend = PagedAttentionBackend("cpu", use_kernel=False)
            backend.kernel, backend.kernel_dtypes = triton_paged.paged_attention, (dtype,)
            out, ref = _run_step(backend, dtype, Hq, Hkv, window, [1, 1, 7, 1], [0, 13, 0, 30], D=24,
                                 sinks=_sinks(Hq))
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_triton_kernel_under_interpreter():
    if not triton_paged.available():
        pytest.skip("triton not installed")
    # the checkout's tokenmill, not an installed one, whatever the subprocess's working directory puts first
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    code = "import test_attention as t; t._triton_check()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("Hq,Hkv,window", [(8, 2, None), (6, 1, None), (9, 3, 5)])
def test_cuda_backend_matches_cpu_backend(dtype, tol, Hq, Hkv, window):
    cuda = PagedAttentionBackend("cuda")
    assert cuda.name == ("triton_paged" if triton_paged.available() else "torch_sdpa")
    args = (dtype, Hq, Hkv, window, [1, 1, 7, 1, 5, 1, 1], [0, 13, 0, 30, 9, 2, 200])
    out_gpu, ref = _run_step(cuda, *args, bs=16, D=64, device="cuda")
    cpu_dtype = torch.float32 if dtype == torch.float16 else dtype
    out_cpu, _ = _run_step(PagedAttentionBackend("cpu"), cpu_dtype, *args[1:], bs=16, D=64)
    torch.testing.assert_close(out_gpu.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(out_gpu.float(), out_cpu.float(), atol=tol, rtol=tol)


def test_kernel_kv_write_equals_index_copy():
    """The C write of a step's k/v (rows strided like slices of qkv) lands exactly where index_copy_ puts it;
    a slot outside the cache raises and writes nothing."""
    if cpu_kernels.load() is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    T, Hkv, D, N, bs = 5, 3, 64, 7, 4
    qkv = torch.randn(T, 4 * Hkv * D, generator=g)
    k = qkv[:, 2 * Hkv * D:3 * Hkv * D].view(T, Hkv, D)
    v = qkv[:, 3 * Hkv * D:].view(T, Hkv, D)
    slots = torch.tensor([0, 5, 6, 13, 27])
    ours, ref = torch.zeros(2, Hkv, N, bs, D), torch.zeros(2, Hkv, N, bs, D)
    assert cpu_kernels.write_kv(ours, k, v, slots)
    ref[0].view(Hkv, -1, D).index_copy_(1, slots, k.transpose(0, 1))
    ref[1].view(Hkv, -1, D).index_copy_(1, slots, v.transpose(0, 1))
    assert torch.equal(ours, ref)
    with pytest.raises(IndexError):
        cpu_kernels.write_kv(torch.zeros(2, Hkv, N, bs, D), k, v, torch.tensor([0, 1, 2, 3, N * bs]))
