"""KV groups (step/kv_groups.py, engine/kv_cache_manager.py): sliding-window layers give back the blocks that left
their window. The layouts and the engines that keep one group, the KV manager's freeing and its prefix hits
(searched from the right per sliding group), exactness against transformers with groups on (tiny Gemma 3: local
and global layers; tiny Mistral: a window on every layer), the live-block bound while a long request runs, the
admission gain at a fixed KV budget, and tokenmill plan's KV bytes agreeing with the engine's."""
from __future__ import annotations

import torch
import pytest
from transformers import AutoConfig

from test_gemma3 import GREEDY, _assert_matches
from test_model_exactness import _hf_reference, _prompts
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.kv_cache_manager import NULL_BLOCK_ID, KVCacheManager
from tokenmill.messages import EngineCoreRequest, Request
from tokenmill.perf.memory import PRESETS, ModelShape, memory_plan
from tokenmill.step.kv_groups import group_layers, kv_layout


# -- layouts -------------------------------------------------------------------------------------------------
def test_layouts_group_layers_by_kind():
    gemma = ["sliding"] * 5 + ["full"]
    windows = [1024 if kind == "sliding" else None for kind in gemma * 10 + ["sliding"] * 2]  # 62 layers: 27B
    layout = group_layers(windows)
    assert layout.num_slots == 10 and layout.windows == (None,) + (1024,) * 6  # 52 local layers: 6 groups, padded
    assert layout.groups[0].layers == tuple(range(5, 62, 6)) and layout.groups[-1].layers == (60, 61)
    assert all(layout.groups[layout.layer_group[i]].layers[layout.layer_slot[i]] == i for i in range(62))
    mistral = group_layers([48] * 4)
    assert len(mistral.groups) == 1 and mistral.num_slots == 4 and mistral.frees_blocks
    plain = group_layers([None] * 4)
    assert (plain.windows, plain.num_slots, plain.frees_blocks) == ((None,), 4, False)
    mixed = group_layers([8, 16, 16, 8])  # separate kinds per window length, no full layers
    assert mixed.windows == (8, 16) and mixed.num_slots == 2
    # a step of 64 tokens after 47 positions of window: 8 blocks of 16 (the window may start inside a block)
    assert mistral.max_blocks(1000, 16, 64) == 8 and plain.max_blocks(1000, 16, 64) == 63


def test_engines_that_cannot_use_groups_keep_one(tiny):
    hf = AutoConfig.from_pretrained(tiny("gemma3"))

    def layout(max_model_len=1024, **kw):
        return kv_layout(EngineConfig.from_kwargs(hf_config=hf, max_model_len=max_model_len, **kw))

    assert layout().windows == (None, 24, 24) and layout().one_group_reason is None
    for kw, reason in [(dict(kv_offloading_size=1.0), "KV tiers"),
                       (dict(kv_transfer_config={"kv_connector": "TokenmillConnector", "kv_role": "kv_both"}),
                        "disaggregated"),
                       (dict(speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2}),
                        "draft_model drafter"),
                       (dict(disable_hybrid_kv_cache_manager=True), "--disable-hybrid-kv-cache-manager")]:
        one = layout(**kw)
        assert one.windows == (None,) and one.num_slots == 3 and reason in one.one_group_reason
        assert reason in one.describe()
    ngram = layout(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert ngram.windows == (None, 24, 24)  # prompt lookup keeps no KV: groups stay on
    assert layout(max_model_len=24).windows == (None,)  # no request outgrows the window: nothing to free


# -- the KV manager ------------------------------------------------------------------------------------------
def _req(rid: str, n: int) -> Request:
    return Request(EngineCoreRequest(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4)), 1024)


def test_sliding_group_gives_back_blocks_and_hits_from_the_right():
    kv = KVCacheManager(num_blocks=40, block_size=4, windows=(None, 6))
    a = _req("a", 30)
    assert kv.allocate_slots(a, 30)
    a.num_computed_tokens = 30
    assert kv.live_blocks("a") == [8, 8] and kv.pool.num_free == 39 - 16
    kv.free_out_of_window(a)  # the next query (position 30) reads 25..30: blocks 6 and 7
    assert kv.live_blocks("a") == [8, 2] and kv.pool.num_free == 39 - 10
    full, sliding = kv.new_block_ids("a", 0)
    assert sliding[:6] == [NULL_BLOCK_ID] * 6 and NULL_BLOCK_ID not in full and len(full) == len(sliding)
    freed = kv.req_blocks["a"][1]
    kv.free(a)
    assert kv.is_whole()

    # 7 full blocks of the same tokens are cached in both groups (the sliding group's kept their hash)
    hits, n = kv.get_computed_blocks(_req("b", 30))
    assert n == 28 and [len(h) for h in hits] == [7, 7]
    assert hits[1][:5] == [kv.pool.null] * 5  # a query at 28 reads 23..28: blocks 5 and 6
    # The sliding group loses block 6: no hit may read it, the next candidate ends before it (24 tokens, reading
    # blocks 4 and 5), although the full group still has a block 6 (the same tokens, another group's key).
    kv.pool.unregister(hits[1][6])
    c = _req("c", 30)
    hits, n = kv.get_computed_blocks(c)
    sliding = [kv.pool.lookup(1, h) for h in c.block_hashes[:7]]
    assert n == 24 and hits[1][4:] == sliding[4:6] and kv.pool.lookup(0, c.block_hashes[6]) is not None
    assert not set(hits[0]) & set(hits[1][4:])
    kv.pool.unregister(hits[1][4])  # now 24 tokens lack block 4: down to 16, reading blocks 2 and 3
    e = _req("e", 30)
    hits, n = kv.get_computed_blocks(e)
    assert n == 16 and hits[1] == [kv.pool.null] * 2 + sliding[2:4] and len(hits[0]) == 4
    assert kv.allocate_slots(e, 30 - n, hits)
    assert kv.live_blocks("e") == [8, 6] and kv.req_blocks["e"][1][2] is sliding[2]
    kv.free(e)
    assert kv.is_whole() and len(freed) == 8


# -- the engine ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, blocks", [("gemma3", 40), ("mistral", 24)])
def test_matches_transformers_with_chunks_preemption_and_prefix_hits(tiny, arch, blocks):
    """Prompts of 1..300 tokens (windows 24 and 48) in 64-token steps, a cache that forces preemption, then the
    same prompts again: prefix-cache hits whose sliding groups bring only their window."""
    path = tiny(arch)
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=blocks, block_size=16, max_num_batched_tokens=64)
    assert llm.engine.scheduler.kv_layout.frees_blocks
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    refs = _hf_reference(path, prompts)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    # newest first: the last prompts' blocks are the last the pool would evict
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], GREEDY, use_tqdm=False)[::-1]
    print(arch, [o.num_cached_tokens for o in again])
    assert sum(o.num_cached_tokens for o in again) >= 64, "the test must exercise prefix-cache hits"
    assert llm.engine.scheduler.kv.is_whole()
    _assert_matches(first, refs)
    _assert_matches(again, refs)


@pytest.mark.parametrize("arch, block_size", [("gemma3", 8), ("mistral", 16)])
def test_long_request_holds_at_most_the_window(tiny, arch, block_size):
    """A 300-token prompt (64-token chunks) and 100 more tokens, far past the window: after every step each
    sliding group holds at most window / block_size + 1 blocks, the full group all of them; the tokens are those
    of an engine keeping every block (one group, the window only masking)."""
    path = tiny(arch)
    prompt = _prompts(400)[1]
    sp = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    kw = dict(dtype="float32", block_size=block_size, max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20)
    llm = LLM(path, **kw)
    eng, layout = llm.engine, llm.engine.scheduler.kv_layout
    eng.add_request(EngineCoreRequest("long", prompt, sp))
    tokens, steps = [], 0
    while eng.has_unfinished_requests():
        tokens += [t for o in eng.step() for t in o.new_token_ids]
        req = eng.scheduler.requests.get("long")
        if req is None:
            break
        steps += 1
        for group, live in zip(layout.groups, eng.scheduler.kv.live_blocks("long")):
            if group.window is None:
                assert live == -(-req.num_computed_tokens // block_size)
            else:
                assert live <= group.window // block_size + 1, f"step {steps}: {live} blocks"
    assert steps >= 100 and eng.scheduler.kv.is_whole()
    one_group = LLM(path, disable_hybrid_kv_cache_manager=True, **kw)
    assert one_group.engine.scheduler.kv_layout.windows == (None,)
    assert tokens == one_group.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids


def _peak_running(path: str, budget: int, **kw) -> int:
    """Most requests running at once: 24 requests of 480 + 48 tokens, 256-token steps, `budget` KV bytes."""
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=budget, max_num_batched_tokens=256, **kw)
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i in range(24):
        eng.add_request(EngineCoreRequest(f"r{i}", torch.randint(3, 300, (480,), generator=g).tolist(), sp))
    peak = 0
    while eng.has_unfinished_requests():
        eng.step()
        peak = max(peak, eng.scheduler.num_running)
    assert eng.scheduler.kv.is_whole()
    return peak


@pytest.mark.parametrize("arch, least", [("gemma3", 2.0), ("mistral", 4.0)])
def test_fixed_kv_budget_admits_more_long_requests(tiny, arch, least):
    """The same KV bytes (120 blocks of every layer) hold ~3.5 such requests with the window ignored; with KV
    groups Gemma 3's two local layers of three keep ~2 blocks each instead of 33 (ratio ~2.5), Mistral's every
    layer ~4 (all 24 requests fit)."""
    path = tiny(arch)
    probe = LLM(path, dtype="float32", num_gpu_blocks_override=4, disable_hybrid_kv_cache_manager=True)
    budget = 120 * probe.engine.executor.bytes_per_block()
    ignored = _peak_running(path, budget, disable_hybrid_kv_cache_manager=True)
    grouped = _peak_running(path, budget)
    print(f"{arch}: {grouped} long requests at once with KV groups, {ignored} with the window ignored: "
          f"{grouped / ignored:.2f}x")
    assert grouped / ignored >= least


def test_ngram_speculation_runs_with_groups(tiny):
    """Prompt lookup keeps no KV of its own, so groups stay on; rejected drafts only lower num_computed_tokens
    to no less than the step's start, so nothing given back is needed again."""
    path = tiny("mistral")
    prompt = (list(range(5, 45)) * 8)[:300]  # repetitive: the drafter proposes
    sp = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    spec = LLM(path, dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.engine.scheduler.kv_layout.frees_blocks
    plain = LLM(path, dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20)
    got = spec.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.engine.stats().spec_num_draft_tokens > 0 and spec.engine.scheduler.kv.is_whole()


# -- tokenmill plan ------------------------------------------------------------------------------------------
def test_plan_counts_sliding_layers_up_to_the_window_as_the_engine_allocates(tiny):
    path = tiny("gemma3")
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(path))
    per_layer_token = 2 * 2 * 32 * 4  # K and V, 2 KV heads of 32, float32
    assert shape.windows == (24, None, 24) and shape.kv_bytes_per_token("fp32") == 3 * per_layer_token
    assert shape.kv_bytes_per_seq("fp32", 1000) == per_layer_token * (1000 + 2 * 24)
    assert shape.kv_bytes_per_seq("fp32", 10) == per_layer_token * 30
    llm = LLM(path, dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20)
    assert llm.engine.executor.bytes_per_block() == shape.kv_bytes_per_block_token("fp32") * 8 == 8 * per_layer_token
    # the engine's blocks per sequence: its KV bytes within a block per group of the plan's
    prompt = _prompts(400)[1]
    eng = llm.engine
    eng.add_request(EngineCoreRequest("r", prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
    eng.step()  # ... until the prompt has run
    while eng.scheduler.requests["r"].num_computed_tokens < len(prompt):
        eng.step()
    held = sum(eng.scheduler.kv.live_blocks("r")) * eng.executor.bytes_per_block()
    planned = shape.kv_bytes_per_seq("fp32", len(prompt))
    assert planned <= held <= planned + 3 * eng.executor.bytes_per_block()
    # Gemma-3-27B at 32k context: 10 global layers x 32768 + 60 local slots x 1024, not 62 x 32768
    big = ModelShape.from_hf_config(PRESETS["Gemma-3-27B"])
    per = big.kv_bytes_per_token("bf16") // 62
    assert big.kv_bytes_per_seq("bf16", 32768) == per * (10 * 32768 + 60 * 1024)
    plan = memory_plan(big, "bf16", "bf16", 32768, 80 * 2**30, num_gpus=2)
    assert plan.kv_bytes_per_seq == per * (10 * 32768 + 60 * 1024) and plan.max_concurrent_seqs > 0
