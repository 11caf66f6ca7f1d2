"""KV tiers below the device pool (tokenmill/kv_transfer): the offloading scheduler's plans, the host pool's
copies for every KV dtype, the disk store's checksums, and the engine restoring evicted prefixes from host RAM
and disk with outputs identical to recomputing them (and recomputing what is corrupt or missing)."""
import argparse
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.engine.kv_cache_manager import hash_block
from tokenmill.messages import EngineCoreRequest
from tokenmill.kv_transfer.disk_store import DiskBlockStore
from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.step.offload_plan import DELETE, READ, WRITE, WRITE_FROM_DEVICE, OffloadOutput
from tokenmill.kv_transfer.offload_scheduler import OffloadingScheduler

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
BLOCK_BYTES = 8192  # tiny qwen2 in float32: 2 layers x K,V x 2 heads x 16 tokens x 16 dims x 4 bytes
H = [bytes([i]) * 16 for i in range(8)]


def _rand(n, seed, vocab=300):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


A = _rand(150, seed=1)                             # 9 full blocks + 6 tokens
FILLERS = [_rand(150, seed=s) for s in (2, 3, 4)]  # each takes 10 of the 12 device blocks


# -- the scheduler half, on its own ------------------------------------------------------------
def _fake_req(rid, hashes):
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=4 * len(hashes) + 1)


def test_scheduler_plans_saves_spills_reads_and_loads():
    s = OffloadingScheduler(block_size=4, num_host_blocks=2, num_disk_blocks=2)
    s.on_evict(10, H[0])
    s.on_evict(11, H[1])
    plan = s.build_plan()
    assert plan.saves == [(10, 0), (11, 1)] and not plan.disk_ops and not plan.loads
    s.on_evict(12, H[2])   # host full: its LRU block goes to disk, its slot takes the new one
    s.on_evict(13, H[3])
    s.on_evict(14, H[4])   # every slot is saved into this step: the oldest save (H2) goes to disk instead,
    plan = s.build_plan()  # straight from its device block, and disk being full, its LRU file is deleted
    assert plan.disk_ops == [(WRITE, H[0], 0), (WRITE, H[1], 1), (DELETE, H[0], -1), (WRITE_FROM_DEVICE, H[2], 12)]
    assert plan.saves == [(13, 1), (14, 0)]
    assert list(s.host) == [H[3], H[4]] and list(s.disk) == [H[1], H[2]] and not s.counters().get("dropped_blocks")

    # H4 (host) then H2 (disk): the request waits for the read, then hits both.
    req = _fake_req("r", [H[4], H[2]])
    assert not s.lookup(req, 0).ready and not s.is_ready(req)
    plan = s.build_plan()  # the read's slot is H3's (H4 is held by the request); H3 goes to disk first
    assert plan.disk_ops == [(DELETE, H[1], -1), (WRITE, H[3], 1), (READ, H[2], 1)]
    s.update(OffloadOutput([(H[2], True)]))
    assert s.is_ready(req) and s.lookup(req, 0).num_tokens == 8
    s.on_allocated(req, [20, 21])
    assert s.build_plan().loads == [(0, 20), (1, 21)]
    assert s.idle()

    # A failed read (corrupt file) forgets the file: the next lookup stops there.
    req = _fake_req("q", [H[3]])
    assert not s.lookup(req, 0).ready
    s.build_plan()
    s.update(OffloadOutput([(H[3], False)]))
    assert s.is_ready(req) and s.lookup(req, 0).num_tokens == 0 and H[3] not in s.disk
    s.release(req)
    assert s.idle() and s.counters()["failed_blocks"] == 1


def _evict_tail_first(s, chain, first_block_id=100):
    """What the device pool does when a request's blocks are reused: its tail block goes first."""
    for i, h in reversed(list(enumerate(chain))):
        s.on_evict(first_block_id + i, h)


CHAIN = [bytes([0xC0 + i]) * 16 for i in range(10)]


@pytest.mark.parametrize("num_disk_blocks", [0, 20])
def test_a_chain_evicted_in_one_step_keeps_its_head(num_disk_blocks):
    """More blocks than host slots in one step: the host keeps the chain's head (a lookup starts there), and
    the rest goes straight to disk when there is one."""
    s = OffloadingScheduler(block_size=4, num_host_blocks=3, num_disk_blocks=num_disk_blocks)
    _evict_tail_first(s, CHAIN)
    plan = s.build_plan()
    assert list(s.host) == CHAIN[2::-1] and sorted(block for block, _ in plan.saves) == [100, 101, 102]
    assert s.lookup(_fake_req("r", CHAIN), 0).num_tokens == 3 * 4
    s.release(_fake_req("r", CHAIN))
    if num_disk_blocks:
        assert plan.disk_ops == [(WRITE_FROM_DEVICE, h, 100 + i) for i, h in reversed(list(enumerate(CHAIN)))
                                 if i >= 3]
        assert s.counters()["spilled_blocks"] == 7 and not s.counters().get("dropped_blocks")
    else:
        assert not plan.disk_ops and s.counters()["dropped_blocks"] == 7


OTHER = [bytes([0xD0 + i]) * 16 for i in range(10)]


def test_a_step_keeps_a_chains_head_over_another_chains_tail():
    """One step evicts the head of chain a (its tail went before) and the tail of chain b (its head stays on
    the device): with 3 slots the host keeps a's head and b's blocks nearest b's start, not the first or last
    three to arrive."""
    s = OffloadingScheduler(block_size=4, num_host_blocks=3, num_disk_blocks=0)
    a, b = CHAIN[:4], OTHER[:6]
    s.release(_fake_req("a", a))  # the connector learns chains from the requests it sees
    s.release(_fake_req("b", b))
    _evict_tail_first(s, a[:2])
    _evict_tail_first(s, b[2:], first_block_id=200)
    s.build_plan()
    assert set(s.host) == {a[0], a[1], b[2]} and s.counters()["dropped_blocks"] == 3
    assert s.lookup(_fake_req("a", a), 0).num_tokens == 8
    assert s.lookup(_fake_req("b", b), 8).num_tokens == 4  # b's first two blocks are on the device


def test_host_tier_evicts_a_looked_up_chain_from_its_tail():
    """A lookup touches the run it found tail first: later pressure takes the chain's tail, not its head."""
    s = OffloadingScheduler(block_size=4, num_host_blocks=4, num_disk_blocks=0)
    _evict_tail_first(s, CHAIN[:4])
    s.build_plan()
    req = _fake_req("r", CHAIN[:4])
    assert s.lookup(req, 0).num_tokens == 16
    s.release(req)
    s.on_evict(200, H[0])
    s.on_evict(201, H[1])
    s.build_plan()
    assert list(s.host) == [CHAIN[1], CHAIN[0], H[0], H[1]]
    assert s.lookup(req, 0).num_tokens == 8
    s.release(req)
    assert s.idle()


def test_host_tier_evicts_leaves_first():
    """A chain that entered the host tier head first (its head the least recent): the tier evicts its tail (no
    child of it is held there), not the head every lookup needs first."""
    s = OffloadingScheduler(block_size=4, num_host_blocks=3, num_disk_blocks=0)
    req = _fake_req("r", CHAIN[:3])
    s.release(req)  # the connector learns the chain
    for i in range(3):
        s.on_evict(100 + i, CHAIN[i])
        s.build_plan()
    s.on_evict(200, H[0])
    s.build_plan()
    assert list(s.host) == [CHAIN[0], CHAIN[1], H[0]]
    assert s.lookup(req, 0).num_tokens == 8
    s.release(req)
    assert s.idle()


def test_pinned_slots_are_never_evicted():
    s = OffloadingScheduler(block_size=4, num_host_blocks=2, num_disk_blocks=0)
    s.on_evict(1, H[0])
    s.on_evict(2, H[1])
    s.build_plan()
    req = _fake_req("r", [H[0]])
    assert s.lookup(req, 0).num_tokens == 4       # holds H0's slot until admitted
    s.on_evict(3, H[2])                            # takes H1's slot, not H0's
    s.on_evict(4, H[3])                            # both slots are in use this step: dropped
    assert H[0] in s.host and s.counters()["dropped_blocks"] == 1
    s.on_allocated(req, [7])
    assert s.build_plan().loads == [(0, 7)] and s.idle()


# -- worker storage ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_host_pool_round_trips_blocks_bit_exactly(dtype):
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randn(2, 2, 6, 4, 8, generator=g).mul(20).to(dtype) for _ in range(2)]
    kvs.append(torch.randn(2, 1, 6, 4, 16, generator=g).to(dtype))  # a drafter's cache of another shape
    before = [kv.clone() for kv in kvs]
    pool = HostBlockPool(kvs, num_slots=3)
    assert pool.block_nbytes == sum(kv[:, :, 0].numel() for kv in kvs) * kvs[0].element_size()
    pool.save([1, 4], [2, 0])
    assert np.array_equal(pool.copy_out([1, 4]), pool.rows_np[[2, 0]])  # a disk write's own copy
    for kv in kvs:
        kv.zero_()
    pool.load([2, 0], [3, 5])
    for kv, old in zip(kvs, before):
        assert torch.equal(kv[:, :, 3].view(torch.uint8), old[:, :, 1].view(torch.uint8))
        assert torch.equal(kv[:, :, 5].view(torch.uint8), old[:, :, 4].view(torch.uint8))
        assert not kv[:, :, [0, 1, 2, 4]].view(torch.uint8).any()


def test_disk_store_checks_every_read(tmp_path):
    rows = np.zeros((2, 256), dtype=np.uint8)
    store = DiskBlockStore(str(tmp_path), rows, fingerprint=b"F" * 16)
    data = np.arange(256, dtype=np.uint8)

    def read(h):
        store.read(h, 1)
        store.flush()
        return store.finished_reads()

    store.write(H[1], data.copy())
    assert read(H[1]) == [(H[1], True)] and np.array_equal(rows[1], data)
    path = store.path_of(H[1])
    raw = bytearray(open(path, "rb").read())
    raw[100] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    assert read(H[1]) == [(H[1], False)] and not os.path.exists(path)  # a corrupt file is removed
    assert read(H[1]) == [(H[1], False)]                                # missing
    store.write(H[2], data.copy())
    store.flush()
    os.replace(store.path_of(H[2]), path)                               # another block's file
    assert read(H[1]) == [(H[1], False)]
    store.write(H[3], data.copy())
    store.flush()
    with open(store.path_of(H[3]), "r+b") as f:
        f.truncate(200)
    assert read(H[3]) == [(H[3], False)]
    store.close()
    assert not os.path.exists(store.dir)


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny):
    """A's greedy output (token ids and logprobs) with no caching at all."""
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=12, enable_prefix_caching=False)
    assert llm.engine.executor.bytes_per_block() == BLOCK_BYTES
    return llm.generate([{"prompt_token_ids": A}], GREEDY, use_tqdm=False)[0].outputs[0]


def _tiered(tiny, host_blocks, disk_dir=None, max_num_batched_tokens=64, **kw):
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=max_num_batched_tokens,
              kv_offloading_size=f"{host_blocks * BLOCK_BYTES}B", kv_offloading_disk_dir=disk_dir, **kw)
    computed = [0]  # tokens the model ran (prompt tokens computed + decode steps)
    run = llm.engine.executor.execute_model

    def counting(so):
        computed[0] += sum(len(s.token_ids) for s in so.scheduled)
        return run(so)

    llm.engine.executor.execute_model = counting
    return llm, computed


def _gen(llm, prompt, sp=GREEDY):
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]


def _rerun_a(llm, computed):
    """Push A out of the device pool with the fillers, run it again: (output, tokens the model computed)."""
    for f in FILLERS:
        _gen(llm, f)
    disk = llm.engine.executor.collective_rpc(lambda w: w.kv_connector.offload.disk)[0]
    if disk is not None:
        disk.flush()
    before = computed[0]
    out = _gen(llm, A)
    return out, computed[0] - before


def _assert_same(out, expected):
    assert out.token_ids == expected.token_ids
    for got, exp in zip(out.logprobs, expected.logprobs):
        assert set(got) == set(exp)
        assert all(abs(got[t].logprob - exp[t].logprob) < 1e-4 for t in got)


def _assert_clean(llm):
    sched = llm.engine.scheduler
    assert sched.kv.is_whole() and sched.connector.offload.idle() and not sched.loading


def test_host_tier_restores_an_evicted_prefix(tiny, reference):
    llm, computed = _tiered(tiny, host_blocks=40)
    _assert_same(_gen(llm, A).outputs[0], reference)
    out, ran = _rerun_a(llm, computed)
    assert out.num_cached_tokens == 144
    assert ran == (150 - 144) + (GREEDY.max_tokens - 1)  # the uncached tail, then one token per decode step
    _assert_same(out.outputs[0], reference)
    c = llm.engine.scheduler.connector.offload.counters()
    assert c["host_hit_blocks"] == 9 and not c.get("disk_hit_blocks") and not c.get("dropped_blocks")
    stats = llm.engine.stats()
    assert stats.external_prefix_cache_hits == 144 and stats.prefix_cache_hits == 0
    _assert_clean(llm)


def test_disk_tier_restores_and_recomputes_corrupt_or_missing_blocks(tiny, reference, tmp_path):
    llm, computed = _tiered(tiny, host_blocks=10, disk_dir=str(tmp_path))
    connector = llm.engine.scheduler.connector.offload
    disk = llm.engine.executor.collective_rpc(lambda w: w.kv_connector.offload.disk)[0]
    _gen(llm, A)
    out, ran = _rerun_a(llm, computed)
    assert connector.counters()["disk_hit_blocks"] >= 9  # A came back from disk, through the host tier
    assert out.num_cached_tokens == 144 and ran == 6 + 3
    _assert_same(out.outputs[0], reference)

    chain = []
    for i in range(9):
        chain.append(hash_block(chain[-1] if chain else None, A[16 * i:16 * (i + 1)], None))
    for damage, first_bad in (("flip", 4), ("delete", 2)):
        for f in FILLERS:  # A's blocks leave the device and host tiers again; their files stay
            _gen(llm, f)
        disk.flush()
        path = disk.path_of(chain[first_bad])
        if damage == "flip":
            raw = bytearray(open(path, "rb").read())
            raw[len(raw) // 2] ^= 0x5A
            open(path, "wb").write(bytes(raw))
        else:
            os.remove(path)
        failed = connector.counters()["failed_blocks"] if "failed_blocks" in connector.counters() else 0
        before = computed[0]
        out = _gen(llm, A)
        assert connector.counters()["failed_blocks"] == failed + 1
        assert out.num_cached_tokens == 16 * first_bad          # restored up to the bad block...
        assert computed[0] - before == 150 - 16 * first_bad + 3  # ...and everything after it recomputed
        _assert_same(out.outputs[0], reference)
    _assert_clean(llm)
    llm.engine.shutdown()
    assert not os.listdir(tmp_path)  # the private folder is gone


@pytest.mark.parametrize("disk, host_blocks, order", [(False, 4, "AFA"), (True, 3, "ABFAB")])
def test_a_tiny_host_tier_keeps_the_heads_of_prompts(tiny, tmp_path, disk, host_blocks, order):
    """Each prefill evicts a whole earlier prompt from the device in one step, more blocks than the host tier
    holds: the tier keeps the first blocks of the prompts (a lookup needs them first; the rest goes to disk if
    there is one), so a prompt that comes back is partly restored, with the same output. (It used to keep
    the last blocks to arrive, the tails, and drop the heads: zero hits.)"""
    llm, _ = _tiered(tiny, host_blocks, str(tmp_path) if disk else None, max_num_batched_tokens=2048)
    prompts = {"A": A, "B": FILLERS[2], "F": FILLERS[0]}
    first = {}
    for name in order:
        before = llm.engine.stats().external_prefix_cache_hits
        out = _gen(llm, prompts[name])
        if name not in first:
            first[name] = out.outputs[0]
            continue
        assert llm.engine.stats().external_prefix_cache_hits - before > 0, name
        _assert_same(out.outputs[0], first[name])
    _assert_clean(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_restores_bit_exactly(tiny, kv_cache_dtype):
    """int8/fp8 blocks move as raw bytes (their scales are per layer): a host-tier restore gives exactly what a
    device prefix hit gives."""
    llm, computed = _tiered(tiny, host_blocks=40, kv_cache_dtype=kv_cache_dtype)
    _gen(llm, A)
    device_hit = _gen(llm, A)
    assert device_hit.num_cached_tokens == 144 and llm.engine.stats().prefix_cache_hits == 144
    restored, ran = _rerun_a(llm, computed)
    assert restored.num_cached_tokens == 144 and ran == 6 + 3
    assert restored.outputs[0].token_ids == device_hit.outputs[0].token_ids
    for got, exp in zip(restored.outputs[0].logprobs, device_hit.outputs[0].logprobs):
        assert {t: lp.logprob for t, lp in got.items()} == {t: lp.logprob for t, lp in exp.items()}
    _assert_clean(llm)


def test_tiers_restore_a_drafters_kv_too(tiny, reference):
    """A KV-keeping drafter shares the target's block ids: its cache moves with the block."""
    spec = {"method": "draft_model", "model": tiny("qwen2"), "num_speculative_tokens": 2}
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=64,
              kv_offloading_size=f"{40 * 2 * BLOCK_BYTES}B", speculative_config=spec)
    assert llm.engine.executor.bytes_per_block() == 2 * BLOCK_BYTES
    longer = GREEDY.clone(max_tokens=12)
    first = _gen(llm, A, longer)
    for f in FILLERS:
        _gen(llm, f)
    out = _gen(llm, A, longer)
    assert out.num_cached_tokens == 144
    assert out.outputs[0].token_ids == first.outputs[0].token_ids
    assert out.outputs[0].token_ids[:4] == reference.token_ids
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    _assert_clean(llm)


def test_tiers_under_preemption_n_and_aborts(tiny, tmp_path):
    """A busy small pool (preemptions, n = 2, shared prefixes) twice: the second round hits the tiers; outputs
    equal those without any caching. A request aborted while its blocks are read from disk leaks nothing."""
    base = _rand(40, seed=3)
    prompts = [base + _rand(8 + 5 * i, seed=10 + i) for i in range(6)] + [_rand(50, seed=99)]
    params = [GREEDY] * 6 + [GREEDY.clone(n=2)]
    off = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=48,
              enable_prefix_caching=False)
    expected = off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=48,
              kv_offloading_size=f"{10 * BLOCK_BYTES}B", kv_offloading_disk_dir=str(tmp_path))
    for _ in range(2):
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for g, e in zip(got, expected):
            for gc, ec in zip(g.outputs, e.outputs):
                _assert_same(gc, ec)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.external_prefix_cache_hits > 0
    _assert_clean(llm)

    _gen(llm, A)
    for seed in (20, 21, 22):  # new prompts (no tier hits holding host slots): A's blocks go down to disk
        _gen(llm, _rand(150, seed=seed))
    llm.engine.executor.collective_rpc(lambda w: w.kv_connector.offload.disk.flush())
    eng = llm.engine
    eng.add_request(EngineCoreRequest("gone", A, GREEDY))
    eng.step()
    assert [r.request_id for r in eng.scheduler.loading] == ["gone"]
    eng.abort_requests(["gone"])
    while eng.has_unfinished_requests():
        eng.step()
    while eng.scheduler.connector.offload.reading:  # its reads still land (in host slots nobody holds)
        eng.step()
    _assert_clean(llm)


def test_offloading_flags_and_errors(tmp_path):
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    a = p.parse_args(["--kv-offloading-size", "8", "--kv-offloading-disk-dir", str(tmp_path),
                      "--kv-offloading-disk-size", "0.5"])
    cache = EngineConfig.from_cli_args(a).cache
    cache.validate()
    assert cache.kv_offloading_bytes == 8 * 2**30 and cache.kv_offloading_disk_bytes == 2**29
    assert CacheConfig(kv_offloading_size="512MiB").validate() is None
    with pytest.raises(ValueError, match="needs a host-RAM tier"):
        CacheConfig(kv_offloading_disk_dir=str(tmp_path)).validate()
    with pytest.raises(ValueError, match="needs prefix caching"):
        CacheConfig(kv_offloading_size=1, enable_prefix_caching=False).validate()
    with pytest.raises(ValueError, match="must not be negative"):
        CacheConfig(kv_offloading_size=-1).validate()


def test_server_reports_tier_hits_per_tenant(tiny):
    """End to end over HTTP: usage.prompt_tokens_details.cached_tokens counts blocks restored from the host
    tier, cache_salt keeps tenants apart, and /metrics shows the tier hits."""
    import time

    import httpx
    from server_utils import ServerProc, metrics

    server = ServerProc(tiny("llama"), "--served-model-name", "m", "--num-gpu-blocks-override", "12",
                        "--kv-offloading-size", f"{64 * BLOCK_BYTES}B")

    def complete(prompt, salt=None):
        body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0, "cache_salt": salt}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    try:
        first = complete(A, "tenant-1")
        assert complete(A, "tenant-2")[0] == 0
        for f in FILLERS:
            complete(f)
        assert complete(A, "tenant-1") == (144, first[1])  # restored from host RAM, same text
        deadline = time.monotonic() + 10
        while (m := metrics(server)).get("tokenmill:external_prefix_cache_hits_total", 0) < 144:
            assert time.monotonic() < deadline, m
            time.sleep(0.1)
        assert m["tokenmill:prefix_cache_hit_rate"] > 0
    finally:
        server.stop()
