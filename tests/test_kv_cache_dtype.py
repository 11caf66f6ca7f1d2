"""--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8: KV stored quantized in the paged cache, dequantized inside
attention (C kernel and torch path), with chunked prefill, prefix caching and preemption in the engine."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu import PagedAttentionBackend, write_kv
from tokenmill.layers.attention.kv_quant import KVCacheQuant

KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def _backends():
    out = [pytest.param(PagedAttentionBackend("cpu", use_kernel=False), id="torch")]
    if shutil.which("cc") or shutil.which("gcc"):
        out.append(pytest.param(PagedAttentionBackend("cpu"), id="kernel"))
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
def test_quantized_cache_attention_matches_dequantized_reference(backend, kv_dtype):
    torch.manual_seed(0)
    Hq, Hkv, D, bs = 8, 2, 32, 4
    ctx = [13, 30, 2]  # cached tokens per request; each then decodes one token
    nbs = [-(-(c + 1) // bs) for c in ctx]
    num_blocks = sum(nbs) + 1
    cache = torch.zeros(2, Hkv, num_blocks, bs, D, dtype=KV_DTYPES[kv_dtype])
    quant = KVCacheQuant(KV_DTYPES[kv_dtype], Hkv)
    table = torch.zeros(len(ctx), max(nbs), dtype=torch.long)
    perm, c = torch.randperm(num_blocks), 0
    for i, nb in enumerate(nbs):
        table[i, :nb] = perm[c:c + nb]
        c += nb
    ks = [torch.randn(n + 1, Hkv, D) * 3 for n in ctx]
    vs = [torch.randn(n + 1, Hkv, D) * 3 for n in ctx]
    slot = lambda i, p: int(table[i, p // bs]) * bs + p % bs  # noqa: E731
    write_kv(cache, torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]),  # the cached context
             torch.tensor([slot(i, p) for i, n in enumerate(ctx) for p in range(n)]), quant)
    q = torch.randn(len(ctx), Hq, D)
    meta = AttentionMetadata(positions=torch.tensor(ctx), slot_mapping=torch.tensor([slot(i, n) for i, n in enumerate(ctx)]),
                             block_table=table, query_start_loc=list(range(len(ctx) + 1)),
                             seq_lens=[n + 1 for n in ctx], block_size=bs)
    out = backend.forward(q, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), cache, meta,
                          D ** -0.5, None, quant)
    for i in range(len(ctx)):  # reference: dense attention over quantize -> dequantize of the same K/V
        kq = quant.dequantize(quant.quantize(ks[i], 0).transpose(0, 1), 0, torch.float32)   # [Hkv, L, D]
        vq = quant.dequantize(quant.quantize(vs[i], 1).transpose(0, 1), 1, torch.float32)
        kq, vq = kq.repeat_interleave(Hq // Hkv, 0), vq.repeat_interleave(Hq // Hkv, 0)
        w = (torch.einsum("hd,hld->hl", q[i], kq) * D ** -0.5).softmax(-1)
        torch.testing.assert_close(out[i], torch.einsum("hl,hld->hd", w, vq), atol=1e-4, rtol=1e-4)
    # and quantization really happened: the round trip is not the identity
    k0 = ks[0].transpose(0, 1)
    assert not torch.equal(quant.dequantize(quant.quantize(ks[0], 0).transpose(0, 1), 0, torch.float32), k0)


def _run(path, kv_cache_dtype, prompts, **kw):
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return llm, outs


@pytest.mark.parametrize("kv_dtype,min_agreement", [("fp8_e4m3", 0.75), ("fp8_e5m2", 0.75), ("int8", 0.9)])
def test_engine_with_quantized_kv_chunked_prefill_prefix_caching_preemption(tiny, kv_dtype, min_agreement):
    path = tiny("llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in [1, 300, 5, 77, 16, 150, 33, 210]]
    _, ref = _run(path, "auto", prompts, num_gpu_blocks_override=24)
    llm, outs = _run(path, kv_dtype, prompts, num_gpu_blocks_override=24)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and sched.kv.is_whole()
    assert llm.engine.executor.collective_rpc(lambda w: w.runner.kv_caches[0].dtype) == [KV_DTYPES[kv_dtype]]
    # a repeated prompt hits the quantized prefix cache
    shared = {"prompt_token_ids": prompts[1][:200] + [7, 8, 9]}
    llm.generate(shared, use_tqdm=False)
    again = llm.generate(shared, use_tqdm=False)
    assert again[0].num_cached_tokens >= 192 and sched.kv.is_whole()
    pairs = [(a, b) for o, r in zip(outs, ref) for a, b in zip(o.outputs[0].token_ids, r.outputs[0].token_ids)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    assert agreement >= min_agreement, f"{kv_dtype}: greedy tokens agree with the unquantized cache {agreement:.0%}"


def test_quantized_kv_holds_more_tokens_and_bad_dtype_is_rejected(tiny):
    path = tiny("llama")
    sizes = {}
    for kv_dtype in ("auto", "int8"):
        llm = LLM(path, dtype="float32", kv_cache_memory_bytes="4MiB", kv_cache_dtype=kv_dtype)
        sizes[kv_dtype] = llm.engine.scheduler.kv.num_blocks
    assert sizes["int8"] == 4 * sizes["auto"]  # fp32 -> 1 byte per value
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(path, dtype="float32", kv_cache_dtype="fp4")


def test_checkpoint_kv_scales_are_loaded(tiny, tmp_path):
    src = tiny("llama")
    dst = tmp_path / "with_scales"
    shutil.copytree(src, dst)
    weights_file = next(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    tensors = load_file(dst / weights_file)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(tensors, dst / weights_file, metadata={"format": "pt"})
    llm = LLM(str(dst), dtype="float32", kv_cache_dtype="fp8_e4m3", num_gpu_blocks_override=32)
    attn = llm.engine.executor.collective_rpc(lambda w: w.model.layers[0].self_attn)[0]
    assert attn.kv_quant.scale[0].tolist() == [0.5] * attn.num_kv_heads
    assert attn.kv_quant.scale[1].tolist() == [0.25] * attn.num_kv_heads
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("RssAnon")).split()[1])


def test_kv_pool_is_zero_and_costs_memory_only_as_it_fills():
    """zeroed_tensors (the KV cache's layer slots, the target's and a draft model's): views of one allocation,
    all zeros, even where the allocator hands out memory that held other data; a large pool is not touched up
    front."""
    from tokenmill.layers.cpu_memory import LAZY_ZERO_BYTES, zeroed_tensors

    shapes = [(2, 2, 3 * 2**20 // 16, 2)] * 32  # 32 x 3 MiB of float32
    assert 32 * 3 * 2**20 >= LAZY_ZERO_BYTES
    before = _rss_anon_kib()
    pool = zeroed_tensors(shapes, torch.float32, "cpu")
    grown = _rss_anon_kib() - before
    assert grown < 16 * 1024, f"the pool's allocation touched {grown} KiB of its 96 MiB"
    assert [t.shape for t in pool] == [torch.Size(s) for s in shapes]
    assert len({t._base.data_ptr() for t in pool}) == 1
    for t in pool[::7]:  # reads of untouched pages see zeros
        assert t[:, :, ::4096].abs().sum().item() == 0
    pool[3].fill_(1.0)  # each view is its own slot
    assert pool[2].abs().sum().item() == 0 and pool[4].abs().sum().item() == 0
    small = zeroed_tensors([(4, 8), (3,)], torch.bfloat16, "cpu")
    assert all(t.dtype == torch.bfloat16 and not t.any() for t in small) and [t.shape for t in small] == [(4, 8), (3,)]


def test_lazy_zero_zeroes_memory_that_held_data_and_gives_its_pages_back():
    """lazy_zero, under zeroed_tensors: a large torch.empty can be heap memory that held other data (seen in a
    full suite run), so the pool's pages are dropped, not assumed fresh; the partial pages at an unaligned
    view's ends are zeroed in place and nothing outside it changes."""
    from tokenmill.layers.cpu_memory import lazy_zero

    base = torch.full((3 * 2**25 + 8,), -7.0)  # 96 MiB, touched
    before = _rss_anon_kib()
    inner = base[3:-5]  # not page-aligned at either end
    assert lazy_zero(inner)
    assert before - _rss_anon_kib() > 64 * 1024, "the dropped pages are still resident"
    assert inner.abs().sum().item() == 0
    assert base[:3].eq(-7.0).all() and base[-5:].eq(-7.0).all()
