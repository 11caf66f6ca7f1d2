"""Prefix caching: the hash chain, LRU eviction, and the engine with it on vs off (chunked prefill, preemption,
n > 1, aborts), cached_tokens, per-tenant cache_salt, and the prefix-cache metrics."""
import random

from tokenmill import LLM, SamplingParams
from tokenmill.messages import EngineCoreRequest, EngineStats, Request
from tokenmill.engine.kv_cache_manager import KVCacheManager, hash_block

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


def _req(rid, ids, salt=None):
    return Request(EngineCoreRequest(rid, ids, SamplingParams(max_tokens=4), cache_salt=salt), 1024)


def _rand(n, seed, vocab=300):
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _gen(llm, prompts, sp=GREEDY, salt=None):
    return llm.generate([{"prompt_token_ids": p, "cache_salt": salt} for p in prompts], sp, use_tqdm=False)


def _same_outputs(got, expected):
    for g, e in zip(got, expected):
        for gc, ec in zip(g.outputs, e.outputs):
            assert gc.token_ids == ec.token_ids
            for glp, elp in zip(gc.logprobs, ec.logprobs):
                assert set(glp) == set(elp)
                assert all(abs(glp[t].logprob - elp[t].logprob) < 1e-4 for t in glp)


def test_hash_chain_depends_on_parent_tokens_and_salt():
    h = hash_block(None, [1, 2, 3, 4], None)
    assert h == hash_block(None, [1, 2, 3, 4], None) and len(h) == 16  # blake2b: the same in every process
    assert h != hash_block(None, [1, 2, 3, 5], None)
    assert h != hash_block(None, [1, 2, 3, 4], "tenant-a") != hash_block(None, [1, 2, 3, 4], "tenant-b")
    other_parent = hash_block(None, [9, 2, 3, 4], None)
    assert hash_block(h, [5, 6, 7, 8], None) != hash_block(other_parent, [5, 6, 7, 8], None)


def test_lru_keeps_prefix_evicts_tail_first_and_announces_evictions():
    evicted = []
    kv = KVCacheManager(num_blocks=6, block_size=4, on_evict=lambda b, h: evicted.append((b, h)))
    a = _req("a", list(range(1, 14)))  # 3 full blocks + 1 token
    assert kv.allocate_slots(a, 13)
    blocks, hashes = kv.block_ids("a"), list(a.block_hashes)
    kv.free(a)
    twin = _req("twin", list(range(1, 14)))
    hits, n = kv.get_computed_blocks(twin)  # per KV group: one here
    assert n == 12 and [b.block_id for b in hits[0]] == blocks[:3]
    # 4 new blocks: the 2 never used, then a's partial tail, then a's last full block (its prefix stays).
    c = _req("c", [99] * 16)
    assert kv.allocate_slots(c, 16)
    assert evicted == [(blocks[2], hashes[2])]
    hits, n = kv.get_computed_blocks(_req("twin2", list(range(1, 14))))
    assert n == 8 and [b.block_id for b in hits[0]] == blocks[:2]
    # A salted request never sees unsalted blocks (nor another salt's).
    assert kv.get_computed_blocks(_req("s", list(range(1, 14)), salt="tenant"))[1] == 0
    kv.free(c)
    assert kv.is_whole()


def test_repeated_prompt_reports_exact_cached_tokens(tiny):
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32)
    for length in (100, 64, 15):  # chunked prefill (100 > 32); 64: the last full block is computed anyway
        p = _rand(length, seed=length)
        first, again = _gen(llm, [p])[0], _gen(llm, [p])[0]
        assert first.num_cached_tokens == 0
        assert again.num_cached_tokens == (length - 1) // 16 * 16
        _same_outputs([again], [first])
    s = llm.engine.stats()
    assert s.prefix_cache_hits == 96 + 48 + 0 and s.prefix_cache_queries == 2 * (100 + 64 + 15)
    assert llm.engine.scheduler.kv.is_whole()


def test_outputs_identical_on_and_off_with_chunking_preemption_and_n(tiny):
    """Shared prefixes, prefill chunks of 48 tokens, and a pool too small for the batch (preemptions)."""
    base = _rand(40, seed=3)
    prompts = [base + _rand(8 + 5 * i, seed=10 + i) for i in range(6)] + [_rand(50, seed=99)]
    params = [GREEDY] * 6 + [GREEDY.clone(n=2)]
    outs = {}
    for caching in (False, True):
        llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=10, max_num_batched_tokens=48,
                  enable_prefix_caching=caching)
        outs[caching] = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        s = llm.engine.stats()
        assert s.num_preemptions > 0
        assert (s.prefix_cache_hits > 0) == caching
        assert llm.engine.scheduler.kv.is_whole()
    _same_outputs(outs[True], outs[False])
    assert outs[True][-1].outputs[0].token_ids == outs[True][-1].outputs[1].token_ids  # greedy siblings


def test_cache_salt_isolates_tenants(tiny):
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=64)
    p = _rand(70, seed=5)
    runs = [(salt, _gen(llm, [p], salt=salt)[0]) for salt in ("a", "b", "a", None, None, "b")]
    assert [r.num_cached_tokens for _, r in runs] == [0, 0, 64, 0, 64, 64]
    _same_outputs([r for _, r in runs[1:]], [runs[0][1]] * 5)
    assert llm.engine.scheduler.kv.is_whole()


def test_abort_during_shared_prefill_keeps_others_exact(tiny):
    llm = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=32, max_num_batched_tokens=40)
    base = _rand(64, seed=8)
    off = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=32, enable_prefix_caching=False)
    alone = _gen(off, [base + [7, 8]])[0].outputs[0].token_ids
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rid, tail in (("keep", [7, 8]), ("drop", _rand(30, seed=9)), ("never", [11])):
        eng.add_request(EngineCoreRequest(rid, base + tail, sp))
    tokens = []
    for _ in range(2):  # "keep" finishes its prefill; "drop" starts its own on the blocks "keep" writes meanwhile
        tokens += [t for o in eng.step() if o.request_id == "keep" for t in o.new_token_ids]
    drop = eng.scheduler.requests["drop"]
    assert drop.num_cached_tokens == 64 and drop.num_computed_tokens < drop.num_tokens
    eng.abort_requests(["drop", "never"])
    while eng.has_unfinished_requests():
        tokens += [t for o in eng.step() if o.request_id == "keep" for t in o.new_token_ids]
    assert tokens == alone
    assert eng.scheduler.kv.is_whole()


def test_prefix_cache_metrics():
    from tokenmill.serve.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.on_engine_stats(EngineStats(0, 0, 0.0, 100, 40, 0, 10, 10))
    m.on_engine_stats(EngineStats(0, 0, 0.0, 300, 120, 0, 10, 10, external_prefix_cache_queries=180,
                                  external_prefix_cache_hits=60))
    text = m.render().decode()
    for line in ('tokenmill:prefix_cache_queries_total{model_name="m"} 300.0',
                 'tokenmill:prefix_cache_hits_total{model_name="m"} 120.0',
                 'tokenmill:external_prefix_cache_queries_total{model_name="m"} 180.0',
                 'tokenmill:external_prefix_cache_hits_total{model_name="m"} 60.0',
                 'tokenmill:prefix_cache_hit_rate{model_name="m"} 0.6'):
        assert line in text

