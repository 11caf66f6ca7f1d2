"""Engine behaviour on a tiny model: prefix caching, sampling, stops, n>1, aborts, block accounting."""
import random

import pytest
import torch

from models import hf_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.frontend import fan_out
from tokenmill.messages import EngineCoreRequest


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=128, block_size=16,
               max_num_batched_tokens=128, seed=0)


def _rand_prompts(n, lo, hi, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _ids(llm, prompts, sp):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def test_prefix_caching_same_tokens_and_reports_hits(tiny, llm):
    vocab = llm.config.model.hf_config.vocab_size
    prompts = _rand_prompts(6, 20, 90, vocab, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    off = LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=128, max_num_batched_tokens=128,
              enable_prefix_caching=False)
    expected = _ids(off, prompts, sp)
    # Twice, with caching on: the second round hits every full block of each prompt.
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in second] == expected
    for p, o in zip(prompts, second):
        assert o.num_cached_tokens == (len(p) - 1) // 16 * 16
    # Caching off: a repeated prompt computes again.
    again = off.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert llm.engine.scheduler.kv.is_whole() and off.engine.scheduler.kv.is_whole()


def test_shared_prefix_in_one_step_matches(llm):
    """Requests sharing a prefix admitted in the same step reuse blocks written in that very step."""
    vocab = llm.config.model.hf_config.vocab_size
    base = _rand_prompts(1, 64, 64, vocab, seed=7)[0]
    prompts = [base + [5 + i] * (i + 1) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    alone = [_ids(llm, [p], sp)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == alone
    assert sum(o.num_cached_tokens for o in together) >= 3 * 64 - 16


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    vocab = llm.config.model.hf_config.vocab_size
    target = _rand_prompts(1, 30, 30, vocab, seed=3)[0]
    others = _rand_prompts(7, 5, 120, vocab, seed=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _ids(llm, [target], sp)[0]
    assert _ids(llm, [target], sp)[0] == alone
    mixed = _ids(llm, others[:3] + [target] + others[3:], [SamplingParams(temperature=0.8, max_tokens=20,
                                                                          ignore_eos=True)] * 3 + [sp] +
                 [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 4)
    assert mixed[3] == alone
    other_seed = _ids(llm, [target], sp.clone(seed=99))[0]
    assert other_seed != alone


def test_sampling_filters_reduce_to_greedy(llm):
    vocab = llm.config.model.hf_config.vocab_size
    prompts = _rand_prompts(3, 10, 40, vocab, seed=5)
    greedy = _ids(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert _ids(llm, prompts, SamplingParams(temperature=0.7, top_k=1, max_tokens=8, ignore_eos=True)) == greedy
    assert _ids(llm, prompts, SamplingParams(temperature=0.7, min_p=1.0, max_tokens=8, ignore_eos=True)) == greedy
    assert _ids(llm, prompts, SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=8, ignore_eos=True)) == greedy


def test_temperature_sampling_matches_distribution(llm):
    """Empirical next-token frequencies follow softmax(logits / T) restricted to top-k."""
    prompt = [7, 8, 9, 10]
    n = 300
    sp = SamplingParams(temperature=1.5, top_k=3, max_tokens=1, n=n, logprobs=3, seed=11)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert len(out.outputs) == n
    top = out.outputs[0].logprobs[0]
    ids = [t for t, lp in top.items() if lp.rank <= 3]
    assert all(c.token_ids[0] in ids for c in out.outputs)
    lps = torch.tensor([top[t].logprob for t in ids]) / 1.5
    probs = lps.softmax(-1)
    counts = torch.tensor([sum(c.token_ids[0] == t for c in out.outputs) for t in ids], dtype=torch.float)
    assert (counts / n - probs).abs().max() < 0.1


def test_repetition_penalty_matches_transformers(tiny, llm):
    vocab = llm.config.model.hf_config.vocab_size
    prompts = _rand_prompts(3, 10, 60, vocab, seed=6)
    ours = _ids(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3))
    model = hf_model(tiny("qwen2"))
    for p, o in zip(prompts, ours):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             repetition_penalty=1.3, pad_token_id=0)[0, len(p):].tolist()
        assert o == ref


def test_presence_and_frequency_penalties(llm):
    """The tiny model loves repeating itself; OpenAI-style penalties must push it off repeats."""
    prompt = [[5, 6, 7, 8, 9]]
    plain = _ids(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    freq = _ids(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0))[0]
    pres = _ids(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=2.0))[0]
    assert len(set(plain)) < len(set(freq))
    assert len(set(plain)) < len(set(pres))


def test_logprobs_and_prompt_logprobs_match_reference(tiny, llm):
    prompt = _rand_prompts(1, 40, 40, llm.config.model.hf_config.vocab_size, seed=8)[0]
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    model = hf_model(tiny("qwen2"))
    with torch.inference_mode():
        ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    plp = out.prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        d = plp[i]
        assert prompt[i] in d and len(d) <= 4
        assert abs(d[prompt[i]].logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert d[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
    first = out.outputs[0].logprobs[0]
    assert abs(max(lp.logprob for lp in first.values()) - ref[-1].max().item()) < 1e-4
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(d[t].logprob for d, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)))


def test_stop_strings_min_tokens_and_stop_token_ids(llm):
    tok = llm.get_tokenizer()
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)] and stop not in out.text
    incl = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert incl.text == text[:text.index(stop) + len(stop)]

    ids = base.outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[4]]),
                       use_tqdm=False)[0].outputs[0]
    first = ids.index(ids[4])
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason == ids[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[0]], min_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 5 and ids[0] not in out.token_ids[:4]
    assert llm.engine.scheduler.kv.is_whole()
    assert tok.decode(base.outputs[0].token_ids) == text


def test_eos_and_max_tokens(llm):
    tok = llm.get_tokenizer()
    biased = SamplingParams(temperature=0, max_tokens=20, logit_bias={tok.eos_token_id: 100.0})
    out = llm.generate("hello", biased, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [tok.eos_token_id] and out.text == ""
    out = llm.generate("hello", biased.clone(ignore_eos=True, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_generation_config_end_tokens_stop_like_eos(tiny, tmp_path):
    """generation_config.json's eos_token_id list (Gemma 3 instruct: <eos> and <end_of_turn>; a GGUF's end-of-turn
    tokens, models/gguf.py) ends a generation as the eos does: stop_reason None, banned under min_tokens,
    ignored with ignore_eos."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny("llama"), model)
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = LLM(str(model), dtype="float32", num_gpu_blocks_override=64)
    ids = ref.generate("hello there", free, use_tqdm=False)[0].outputs[0].token_ids
    eos = ref.get_tokenizer().eos_token_id
    del ref
    end = ids[2]
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, end]}))
    llm = LLM(str(model), dtype="float32", num_gpu_blocks_override=64)
    assert llm.eos_token_ids == [eos, end]
    out = llm.generate("hello there", free.clone(ignore_eos=False), use_tqdm=False)[0].outputs[0]
    first = ids.index(end)
    assert out.token_ids == ids[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    assert llm.generate("hello there", free, use_tqdm=False)[0].outputs[0].token_ids == ids
    banned = llm.generate("hello there", free.clone(ignore_eos=False, min_tokens=first + 2), use_tqdm=False)
    assert end not in banned[0].outputs[0].token_ids[:first + 2]


def test_n_samples_share_prompt_blocks(tiny):
    for caching in (True, False):
        llm = LLM(tiny("llama"), dtype="float32", num_gpu_blocks_override=64, enable_prefix_caching=caching)
        prompt = list(range(10, 10 + 70))
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)[0]
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        assert all(len(c.token_ids) == 6 for c in out.outputs)
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "seeded siblings must differ"
        # Siblings computed the prompt once: 3 of 4 hit its 4 full blocks (the hit counters count only with
        # prefix caching on; without it the siblings share through a salt only they carry).
        kv = llm.engine.scheduler.kv
        assert kv.num_hits == (3 * 64 if caching else 0)
        assert kv.is_whole()
        reqs = fan_out("r", prompt, SamplingParams(n=4, max_tokens=2, ignore_eos=True), None, caching)
        for r in reqs:
            llm.engine.add_request(r)
        llm.engine.step()
        prompt_blocks = [kv.block_ids(r.request_id)[:4] for r in reqs]
        assert all(b == prompt_blocks[0] for b in prompt_blocks), prompt_blocks
        assert len({kv.block_ids(r.request_id)[4] for r in reqs}) == 4  # each sibling writes its own last block
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert kv.is_whole()


def test_abort_returns_blocks_and_others_continue(llm):
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        eng.add_request(EngineCoreRequest(f"a{i}", list(range(5, 45 + i)), sp))
    for _ in range(3):
        eng.step()
    eng.abort_requests(["a1", "a3", "nope"])
    outs = eng.step()
    aborted = {o.request_id for o in outs if o.finish_reason == 2}
    assert aborted == {"a1", "a3"}
    while eng.has_unfinished_requests():
        outs = eng.step()
    assert eng.scheduler.kv.is_whole()


def test_rejects_requests_that_cannot_fit(tiny):
    llm = LLM(tiny("llama"), dtype="float32", num_gpu_blocks_override=4, block_size=16, max_model_len=512)
    with pytest.raises(ValueError, match="exceeds the context length"):
        llm.generate([{"prompt_token_ids": [5] * 500}], SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([{"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], SamplingParams(max_tokens=2), use_tqdm=False)
    # the engine still serves
    out = llm.generate([{"prompt_token_ids": [5] * 10}], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.engine.scheduler.kv.is_whole()


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bad_models_are_one_line_errors(tmp_path, tiny):
    import json
    import shutil

    src = tiny("llama")
    bad_arch = tmp_path / "arch"
    shutil.copytree(src, bad_arch)
    cfg = json.loads((bad_arch / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture FancyNewForCausalLM"):
        LLM(str(bad_arch), num_gpu_blocks_override=4)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(corrupt), num_gpu_blocks_override=4)

    missing = tmp_path / "missing"
    shutil.copytree(src, missing)
    (missing / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(missing), num_gpu_blocks_override=4)
