"""Speculative decoding: every method gives the target's greedy tokens exactly (batching, chunked prefill,
preemption, prefix caching, stops, n > 1), the rejection sampler keeps the target distribution (chi-square),
acceptance is as high as a drafter built to be right makes it, the controller and the metrics."""
import json
import os
import random

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.sampler import SamplingMetadata
from tokenmill.spec_decode.controller import SpecController
from tokenmill.spec_decode.ngram import propose_ngram
from tokenmill.spec_decode.rejection_sampler import rejection_sample

# Small pool + small steps: ~430 prompt tokens and 8 x 24 outputs through 20 blocks of 16 tokens means
# preemption; 32-token steps split prompts into chunks.
PROMPT_LENS = [1, 120, 5, 77, 16, 60, 33, 90]
HARD = dict(dtype="float32", num_gpu_blocks_override=20, block_size=16, max_num_batched_tokens=32, seed=0)
MAX_TOKENS = 24


def _prompts(vocab, lens=PROMPT_LENS, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def _generate(llm, prompts, sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _save(path, config, tensors):
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path


def _head_config(target_dir, **extra):
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    cfg = dict(model_type="llama", hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
               num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
               num_hidden_layers=1, vocab_size=t["vocab_size"], rms_norm_eps=1e-6, max_position_embeddings=1024,
               rope_theta=t.get("rope_theta", 10000.0))
    cfg.update(extra)
    return cfg


def _layer(H, I, heads, kv_heads, q_in, g, scale=0.08):
    hd = H // heads
    r = lambda *s: torch.randn(*s, generator=g) * scale  # noqa: E731
    return {"self_attn.q_proj.weight": r(heads * hd, q_in), "self_attn.k_proj.weight": r(kv_heads * hd, q_in),
            "self_attn.v_proj.weight": r(kv_heads * hd, q_in), "self_attn.o_proj.weight": r(H, heads * hd),
            "post_attention_layernorm.weight": torch.ones(H), "mlp.gate_proj.weight": r(I, H),
            "mlp.up_proj.weight": r(I, H), "mlp.down_proj.weight": r(H, I)}


def random_eagle_head(path, target_dir, seed=0):
    """EAGLE layout (as yuhuili/EAGLE-*): fc [H, 2H] + bias, layers.0.* without input_layernorm; the target's
    embeddings and LM head are reused."""
    cfg = _head_config(target_dir, architectures=["LlamaForCausalLM"])
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 2 * H, generator=g) * 0.08, "fc.bias": torch.zeros(H)}
    t.update({f"layers.0.{k}": v for k, v in _layer(H, I, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                                                     H, g).items()})
    return _save(path, cfg, t)


def random_eagle3_head(path, target_dir, draft_vocab, seed=0, aux=(0, 1, 1)):
    """EAGLE-3 layout (as yuhuili/EAGLE3-*): fc [H, 3H], midlayer.* with hidden_norm/input_layernorm and a
    2H-wide attention input, norm, its own lm_head over a draft vocabulary, d2t and t2d."""
    cfg = _head_config(target_dir, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(draft_vocab),
                       eagle_aux_hidden_state_layer_ids=list(aux))
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": torch.randn(H, 3 * H, generator=g) * 0.08, "norm.weight": torch.ones(H),
         "lm_head.weight": torch.randn(len(draft_vocab), H, generator=g) * 0.08}
    layer = _layer(H, I, cfg["num_attention_heads"], cfg["num_key_value_heads"], 2 * H, g)
    layer.update({"hidden_norm.weight": torch.ones(H), "input_layernorm.weight": torch.ones(H)})
    t.update({f"midlayer.{k}": v for k, v in layer.items()})
    vocab = torch.tensor(sorted(draft_vocab))
    t["d2t"] = vocab - torch.arange(len(vocab))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    t["t2d"] = t2d
    return _save(path, cfg, t)


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = tiny("qwen2")
    # A different random model of the same shape and tokenizer: a draft that is mostly wrong.
    import shutil

    from safetensors.torch import load_file, save_file

    other = str(root / "other-draft")
    shutil.copytree(target, other)
    w = load_file(os.path.join(other, "model.safetensors"))
    g = torch.Generator().manual_seed(99)
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=g)) if v.dim() == 2 else v for k, v in w.items()},
              os.path.join(other, "model.safetensors"))
    with open(os.path.join(target, "config.json")) as f:
        V = json.load(f)["vocab_size"]
    return {"target": target, "other": other,
            "eagle": random_eagle_head(str(root / "eagle"), target),
            "eagle3": random_eagle3_head(str(root / "eagle3"), target, draft_vocab=range(0, V, 2))}


@pytest.fixture(scope="module")
def reference(heads):
    llm = LLM(heads["target"], **HARD)
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, _generate(llm, prompts, sp)


METHODS = {
    "ngram": lambda h: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model_self": lambda h: {"method": "draft_model", "model": h["target"], "num_speculative_tokens": 4},
    "draft_model_other": lambda h: {"method": "draft_model", "model": h["other"], "num_speculative_tokens": 3},
    "eagle": lambda h: {"method": "eagle", "model": h["eagle"], "num_speculative_tokens": 3},
    "eagle3": lambda h: {"method": "eagle3", "model": h["eagle3"], "num_speculative_tokens": 2},
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_greedy_identical_under_batching_chunking_preemption(heads, reference, name):
    prompts, expected = reference
    llm = LLM(heads["target"], speculative_config=METHODS[name](heads), **HARD)
    got = _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()
    st = llm.engine.stats()
    assert st.spec_num_draft_tokens > 0
    if name == "draft_model_self":  # the target drafting for itself: every draft is right
        assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens
        assert st.spec_accepted_per_pos[0] == st.spec_num_drafts


def test_prefix_cache_stops_max_tokens_n(heads):
    """Self-draft (every draft right, so every stop lands inside an accepted run): a second round hits the
    prefix cache and still accepts everything (draft KV of cached blocks is valid); stop token ids, stop
    strings and max_tokens cut exactly where plain decoding does; n > 1 samples work."""
    target = heads["target"]
    kw = dict(dtype="float32", num_gpu_blocks_override=64, block_size=16, max_num_batched_tokens=64)
    base = LLM(target, **kw)
    spec = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 4},
               **kw)
    prompts = _prompts(base.config.model.hf_config.vocab_size, lens=[40, 70, 35], seed=3)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = _generate(base, prompts, sp)
    assert _generate(spec, prompts, sp) == expected
    first = spec.engine.stats()
    again = spec.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again)
    st = spec.engine.stats()
    assert st.spec_num_accepted_tokens - first.spec_num_accepted_tokens == \
        st.spec_num_draft_tokens - first.spec_num_draft_tokens > 0

    # A stop token in the middle of the run; max_tokens not a multiple of k + 1.
    stop_id = expected[0][9]
    cut = expected[0].index(stop_id) + 1
    out = spec.generate([{"prompt_token_ids": prompts[0]}],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id]),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[0][:cut] and out.finish_reason == "stop"
    assert _generate(spec, prompts, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)) == \
        [e[:7] for e in expected]
    # min_tokens bans the stop token on the verified positions before it.
    sp_min = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=cut + 2)
    assert _generate(spec, prompts[:1], sp_min) == _generate(base, prompts[:1], sp_min)
    # Stop strings (the front cuts the text; the engine must not have emitted differently).
    text_prompt = "The quick brown fox"
    plain = base.generate(text_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    stop = plain[0].outputs[0].text[4:8]
    want = base.generate(text_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                         use_tqdm=False)[0].outputs[0]
    got = spec.generate(text_prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                        use_tqdm=False)[0].outputs[0]
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason)
    # n > 1 with seeded sampling, logprobs on speculated positions.
    outs = spec.generate([{"prompt_token_ids": prompts[1]}],
                         SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=2),
                         use_tqdm=False)[0].outputs
    assert len(outs) == 3 and all(len(c.token_ids) == 12 and len(c.logprobs) == 12 for c in outs)
    assert all(t in lp for c in outs for t, lp in zip(c.token_ids, c.logprobs))
    assert spec.engine.scheduler.kv.is_whole() and base.engine.scheduler.kv.is_whole()


def test_greedy_logprobs_equal_plain_decoding(heads, reference):
    prompts, _ = reference
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    base = LLM(heads["target"], dtype="float32", num_gpu_blocks_override=64)
    spec = LLM(heads["target"], dtype="float32", num_gpu_blocks_override=64,
               speculative_config={"method": "draft_model", "model": heads["target"], "num_speculative_tokens": 3})
    a = base.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    b = spec.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for dx, dy in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert list(dx) == list(dy)
            assert all(abs(dx[t].logprob - dy[t].logprob) < 1e-4 and dx[t].rank == dy[t].rank for t in dx)


# -- drafters built to be right: acceptance shows the drafter's alignment (tokens, positions, KV) -----------

@pytest.fixture(scope="module")
def bigram(tiny, tmp_path_factory):
    """A target whose next token depends only on the current one (every layer's output projections zeroed:
    logits = lm_head(norm(embed(t)))), and EAGLE heads that compute exactly that: EAGLE with fc = [I 0] and
    a silent layer outputs embed(t + 1) for position t, so the target's head (norm weights are ones: a
    positive scale) picks the target's own next token; EAGLE-3 copies the embedding through attention that
    attends only to its own position (q = k = a large constant, rotated by position), and its lm_head rows
    are the target's for a draft vocabulary that holds every token the target can produce."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bigram")
    target = str(root / "target")
    shutil.copytree(tiny("qwen2"), target)
    w = load_file(os.path.join(target, "model.safetensors"))
    for k in w:
        if k.endswith("o_proj.weight") or k.endswith("down_proj.weight"):
            w[k] = torch.zeros_like(w[k])
    save_file(w, os.path.join(target, "model.safetensors"))
    emb, head = w["model.embed_tokens.weight"], w["lm_head.weight"]
    V, H = emb.shape
    succ = (emb / emb.pow(2).mean(-1, keepdim=True).sqrt()) @ head.T
    reachable = sorted(set(succ.argmax(-1).tolist()))

    cfg = _head_config(target, architectures=["LlamaForCausalLM"])
    z = {k: torch.zeros_like(v) for k, v in _layer(H, cfg["intermediate_size"], cfg["num_attention_heads"],
                                                   cfg["num_key_value_heads"], H, torch.Generator()).items()}
    z["post_attention_layernorm.weight"] = torch.ones(H)
    eagle = _save(str(root / "eagle"), cfg, {"fc.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1),
                                             **{f"layers.0.{k}": v for k, v in z.items()}})

    heads_n = cfg["num_attention_heads"]
    hd = H // heads_n
    cfg3 = _head_config(target, architectures=["LlamaForCausalLMEagle3"], num_key_value_heads=heads_n,
                        attention_bias=True, draft_vocab_size=len(reachable),
                        eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    big = torch.full((heads_n * hd,), 40.0)
    vocab = torch.tensor(reachable)
    mid = {"hidden_norm.weight": torch.ones(H), "input_layernorm.weight": torch.ones(H),
           "post_attention_layernorm.weight": torch.ones(H),
           "self_attn.q_proj.weight": torch.zeros(H, 2 * H), "self_attn.q_proj.bias": big,
           "self_attn.k_proj.weight": torch.zeros(H, 2 * H), "self_attn.k_proj.bias": big,
           "self_attn.v_proj.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], 1),
           "self_attn.v_proj.bias": torch.zeros(H),
           "self_attn.o_proj.weight": torch.eye(H) * 100.0, "self_attn.o_proj.bias": torch.zeros(H),
           "mlp.gate_proj.weight": torch.zeros(cfg["intermediate_size"], H),
           "mlp.up_proj.weight": torch.zeros(cfg["intermediate_size"], H),
           "mlp.down_proj.weight": torch.zeros(H, cfg["intermediate_size"])}
    eagle3 = _save(str(root / "eagle3"), cfg3, {
        "fc.weight": torch.randn(H, 3 * H, generator=torch.Generator().manual_seed(1)) * 0.01,
        "norm.weight": torch.ones(H), "lm_head.weight": head[vocab], "d2t": vocab - torch.arange(len(vocab)),
        **{f"midlayer.{k}": v for k, v in mid.items()}})
    return {"target": target, "eagle": eagle, "eagle3": eagle3}


@pytest.mark.parametrize("method,k", [("eagle", 3), ("eagle3", 1)])
def test_eagle_heads_built_to_be_right_are_accepted(bigram, method, k):
    """EAGLE: every draft of every position accepted. EAGLE-3's layer adds its output to the incoming hidden
    state, so only the first draft (k = 1) is exact by construction."""
    kw = dict(dtype="float32", num_gpu_blocks_override=64, block_size=16, max_num_batched_tokens=32)
    base = LLM(bigram["target"], **kw)
    prompts = _prompts(base.config.model.hf_config.vocab_size, lens=[3, 50, 20], seed=4)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = _generate(base, prompts, sp)
    spec = LLM(bigram["target"], speculative_config={"method": method, "model": bigram[method],
                                                     "num_speculative_tokens": k}, **kw)
    assert _generate(spec, prompts, sp) == expected
    st = spec.engine.stats()
    assert st.spec_num_draft_tokens > 0
    assert st.spec_num_accepted_tokens == st.spec_num_draft_tokens


# -- rejection sampler --------------------------------------------------------------------------------

def _md(n_rows, temperature=1.0):
    return SamplingMetadata(temperature=torch.full((n_rows,), temperature),
                            greedy=torch.zeros(n_rows, dtype=torch.bool), all_greedy=False)


CHI2_CRIT_DF7_P001 = 24.32  # chi-square critical value, 7 degrees of freedom, p = 0.001


@pytest.mark.parametrize("with_q", [True, False])
def test_rejection_sampler_reproduces_target_distribution(with_q):
    """B = 25,000 requests with k = 2 drafts each drawn from q (or fixed, one-hot q). Every emitted token at
    output position 0 and 1 must follow p (chi-square, p = 0.001)."""
    g = torch.Generator().manual_seed(0)
    V, B, k = 8, 25_000, 2
    p = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
    q = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.20, 0.05, 0.10, 0.05])
    logits = p.log().repeat(B * (k + 1), 1)
    if with_q:
        drafts = torch.multinomial(q, B * k, replacement=True, generator=g)
        draft_probs = q.repeat(B * k, 1)
    else:
        drafts = torch.full((B * k,), 2, dtype=torch.long)  # always propose token 2
        draft_probs = None
    out = rejection_sample(logits, [k] * B, drafts, _md(B * (k + 1)), torch.zeros(B, dtype=torch.bool),
                           draft_probs, generator=g)
    for pos in (0, 1):
        toks = torch.tensor([t[pos] for t in out.token_ids if len(t) > pos])
        counts = torch.bincount(toks, minlength=V).float()
        expected = p * len(toks)
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert len(toks) > 3000 and chi2 < CHI2_CRIT_DF7_P001, (pos, chi2, counts / len(toks))
    acc = sum(out.num_accepted) / (B * k)
    assert 0.05 < acc < 0.95


def test_rejection_sampler_greedy_is_exact_match():
    logits = torch.tensor([[0., 5., 1.], [3., 0., 1.], [0., 0., 9.], [1., 0., 0.],   # request 0: k = 3
                           [0., 1., 0.], [2., 0., 0.]])                               # request 1: k = 1
    md = SamplingMetadata(temperature=torch.ones(6), greedy=torch.ones(6, dtype=torch.bool), all_greedy=True)
    out = rejection_sample(logits, [3, 1], torch.tensor([1, 0, 1, 1]), md, torch.ones(2, dtype=torch.bool))
    assert out.token_ids == [[1, 0, 2], [1, 0]] and out.num_accepted == [2, 1]


def test_end_to_end_sampling_matches_plain(heads):
    """Temperature sampling with speculation: the distribution of the second output token (drawn by the
    rejection sampler) equals plain sampling's (two-sample chi-square over the frequent tokens)."""
    prompt = [7, 8, 9, 10, 11]
    n = 600
    sp = SamplingParams(n=n, temperature=1.0, top_k=6, max_tokens=3, ignore_eos=True, seed=123)
    kw = dict(dtype="float32", num_gpu_blocks_override=256)
    base = LLM(heads["target"], **kw)
    spec = LLM(heads["target"], speculative_config={"method": "draft_model", "model": heads["target"],
                                                    "num_speculative_tokens": 1}, **kw)
    a = [c.token_ids[1] for c in base.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs]
    b = [c.token_ids[1] for c in spec.generate([{"prompt_token_ids": prompt}], sp.clone(seed=456),
                                               use_tqdm=False)[0].outputs]
    assert spec.engine.stats().spec_num_draft_tokens >= n // 2
    ids = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(t) for t in ids], dtype=torch.float)
    cb = torch.tensor([b.count(t) for t in ids], dtype=torch.float)
    keep = (ca + cb) >= 20
    other = torch.stack([ca[~keep].sum(), cb[~keep].sum()])
    ca, cb = torch.cat([ca[keep], other[:1]]), torch.cat([cb[keep], other[1:]])
    tot = ca + cb
    chi2 = float((((ca - tot / 2) ** 2 + (cb - tot / 2) ** 2) / (tot / 2).clamp(min=1)).sum())
    df = int((tot > 0).sum()) - 1
    crit = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5, 7: 24.3, 8: 26.1, 9: 27.9, 10: 29.6}.get(df, 40.0)
    assert chi2 < crit, (chi2, df, ca.tolist(), cb.tolist())


# -- drafters and control -----------------------------------------------------------------------------

def test_ngram_proposals():
    import numpy as np

    h = [np.array([1, 2, 3, 4, 9, 9, 1, 2, 3]), np.array([5, 6, 7]), np.array([4, 1, 2, 8, 1, 2])]
    out = propose_ngram(h, [3, 2, 2], 1, 3)
    assert out[0] == [4, 9, 9]   # suffix [1 2 3] matched at the start
    assert out[1] == []          # no earlier occurrence of anything
    assert out[2] == [8, 1]      # suffix [1 2] -> latest earlier occurrence (positions 1-2)
    assert propose_ngram([np.array([1, 2, 3, 1, 2])], [5], 3, 3) == [[]]  # min_n = 3: no 3-gram repeats


def test_ngram_draft_length_follows_the_match():
    """No more drafts than the match reaches back (past max_n), never more than k; a continuation that runs
    into the present repeats with the match's period."""
    import numpy as np

    copy = np.array([9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7])  # [1..7] matches 7 tokens back
    weak = np.array([5, 1, 2, 3, 9, 1, 2])                                # [1 2] matches 2 tokens back
    assert propose_ngram([copy, weak], [8, 8], 2, 3) == [[8, 0, 1, 2, 3, 4, 5], [3, 9]]
    assert propose_ngram([copy], [3], 2, 3) == [[8, 0, 1]]                # k still caps
    assert propose_ngram([np.array([7] * 6)], [4], 2, 3) == [[7, 7, 7, 7]]           # period 1
    assert propose_ngram([np.array([1, 2] * 4)], [5], 2, 3) == [[1, 2, 1, 2, 1]]    # period 2
    assert propose_ngram([np.array([3, 3])], [5], 1, 3) == [[3]]          # k past the history's length
    assert propose_ngram([np.array([1])], [5], 1, 3) == [[]]


def test_ngram_long_drafts_on_a_loop_are_exact(heads):
    """A prompt that loops lets the drafter propose k = 8 wrapped-around drafts; the output is still exactly
    plain greedy decoding."""
    prompt = [11, 12, 13, 14, 15] * 12
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = _generate(LLM(heads["target"], dtype="float32", seed=0), [prompt], sp)
    llm = LLM(heads["target"], dtype="float32", seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8})
    assert _generate(llm, [prompt], sp) == expected
    assert len(llm.engine.stats().spec_accepted_per_pos) == 8  # full-length drafts were verified


def test_controller_batch_size_and_adaptive():
    c = SpecController(4, disable_by_batch_size=8)
    assert c.choose_k(7) == 4 and c.choose_k(8) == 0

    def run(ctl, batch, step_seconds, accept, steps):
        """Drive the controller: a decode step at k takes step_seconds(k); each draft is accepted with
        probability `accept` (deterministically: the expected count, rounded)."""
        ks = []
        for _ in range(steps):
            k = ctl.choose_k(batch)
            ks.append(k)
            for _ in range(batch):
                m = min(k, round(sum(accept ** i for i in range(1, k + 1))))
                ctl.observe_round(k, m)
            ctl.observe_step(num_tokens=batch * (1 + k), num_decodes=batch, k=k, num_draft_tokens=batch * k,
                             seconds=step_seconds(k))
        return ks

    # Memory-bound steps (drafts nearly free) and good acceptance: the most drafts win.
    fast = SpecController(4, adaptive=True)
    ks = run(fast, 1, lambda k: 0.010 + 0.001 * k, 0.9, 120)
    assert fast.best_k(1) == 4 and ks[-40:].count(4) >= 30 and 0 in ks
    # A big batch where verification is compute-bound: speculation loses; k = 0 wins in that bucket only.
    ks = run(fast, 32, lambda k: 0.030 * (1 + 0.8 * k), 0.9, 80)
    assert fast.best_k(32) == 0 and ks[-40:].count(0) >= 30
    assert fast.best_k(1) == 4
    # Drafts that are never accepted: off even where steps are cheap.
    poor = SpecController(4, adaptive=True)
    ks = run(poor, 1, lambda k: 0.010 + 0.001 * k, 0.0, 120)
    assert poor.best_k(1) == 0 and ks[-40:].count(0) >= 30
    # Steps with prefill chunks, or verifying drafts proposed at another k, are not measured.
    c = SpecController(2, adaptive=True)
    c.observe_step(num_tokens=40, num_decodes=1, k=2, num_draft_tokens=0, seconds=0.1)
    c.observe_step(num_tokens=40, num_decodes=1, k=2, num_draft_tokens=0, seconds=0.1)
    c.observe_step(num_tokens=1, num_decodes=1, k=0, num_draft_tokens=0, seconds=0.1)
    assert c.cost(1, 2) is None and c.cost(1, 0) is None


def test_adaptive_quantized_self_draft_is_exact(heads, reference):
    """An int8 copy of the target drafting for it, adaptive k, no speculation in steps of 6+ requests."""
    prompts, expected = reference
    llm = LLM(heads["target"], speculative_config={"method": "draft_model", "model": heads["target"],
                                                   "quantization": "int8", "num_speculative_tokens": 3,
                                                   "adaptive": True, "disable_by_batch_size": 6}, **HARD)
    assert _generate(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)) == expected
    assert llm.engine.scheduler.kv.is_whole()
    st = llm.engine.stats()
    assert st.spec_num_accepted_tokens > 0.5 * st.spec_num_draft_tokens > 0


def test_config_errors(heads):
    with pytest.raises(ValueError, match="unknown speculative_config key"):
        LLM(heads["target"], speculative_config={"method": "ngram", "num_speculative_tokens": 2, "typo": 1})
    with pytest.raises(ValueError, match="method must be one of"):
        LLM(heads["target"], speculative_config='{"method": "medusa", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(heads["target"], speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="needs \"model\""):
        LLM(heads["target"], speculative_config={"method": "draft_model", "num_speculative_tokens": 2})


def test_metrics_render_spec_counters():
    from tokenmill.messages import EngineStats
    from tokenmill.serve.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.on_engine_stats(EngineStats(1, 0, 0.1, 0, 0, 0, 10, 10, spec_num_drafts=4, spec_num_draft_tokens=12,
                                  spec_num_accepted_tokens=9, spec_accepted_per_pos=[4, 3, 2]))
    m.on_engine_stats(EngineStats(1, 0, 0.1, 0, 0, 0, 10, 10, spec_num_drafts=5, spec_num_draft_tokens=15,
                                  spec_num_accepted_tokens=10, spec_accepted_per_pos=[5, 3, 2]))
    text = m.render().decode()
    assert 'tokenmill:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'tokenmill:spec_decode_num_draft_tokens_total{model_name="m"} 15.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_total{model_name="m"} 10.0' in text
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 5.0' in text
    assert 'tokenmill:spec_decode_draft_acceptance_rate{model_name="m"} 0.666' in text
    assert 'tokenmill:spec_decode_mean_acceptance_length{model_name="m"} 3.0' in text
    from tokenmill.serve.metrics import spec_decode_counters

    assert spec_decode_counters(text) == {"num_drafts": 5.0, "num_draft_tokens": 15.0, "num_accepted_tokens": 10.0,
                                          "accepted_per_pos": [5.0, 3.0, 2.0]}
