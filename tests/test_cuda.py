"""The engine on a CUDA device: the checks the CPU suite makes, run on a GPU when one is visible (skipped
without CUDA). Greedy tokens and logprobs of every architecture against transformers (float32, chunked
prefill and preemption), the same engine in bf16 against the CPU engine, prefix caching, n-gram
speculation, fp8 weights and fp8 KV, the host-RAM KV tier, and the disaggregated pull between two engines
sharing the GPU. `bash benchmarks/gpu_check.sh` runs these, then the timings."""
import random

import pytest
import torch

from models import ARCHS, GEMMA_ARCHS, MOE_ARCHS, hf_model
from tokenmill import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=5)
LENGTHS = [1, 300, 5, 77, 16, 150, 33, 210]


def _prompts(vocab: int, lengths=LENGTHS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _generate(llm, prompts, sp=GREEDY):
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]


def _hf_greedy(path: str, prompts, max_tokens: int):
    model = hf_model(path)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            refs.append((out.sequences[0, len(p):].tolist(), [s[0].float().log_softmax(-1) for s in out.logits]))
    return refs


def _cuda_llm(path, **kw):
    kw.setdefault("dtype", "float32")
    return LLM(path, device="cuda", **kw)


@pytest.mark.parametrize("arch", sorted(ARCHS) + sorted(MOE_ARCHS) + sorted(GEMMA_ARCHS))
def test_greedy_and_logprobs_match_transformers(tiny, arch):
    path = tiny(arch)
    llm = _cuda_llm(path, num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=64)
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    outs = _generate(llm, prompts)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.scheduler.kv.is_whole()
    for p, c, (ref_tokens, ref_lps) in zip(prompts, outs, _hf_greedy(path, prompts, 10)):
        assert c.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        for lp_dict, ref in zip(c.logprobs, ref_lps):
            ids = torch.tensor(list(lp_dict))
            ours = torch.tensor([lp.logprob for lp in lp_dict.values()])
            torch.testing.assert_close(ours, ref[ids], atol=2e-3, rtol=2e-3)
    llm.engine.shutdown()


def _agreement(a, b) -> float:
    pairs = [(x, y) for ca, cb in zip(a, b) for x, y in zip(ca.token_ids, cb.token_ids)]
    return sum(x == y for x, y in pairs) / len(pairs)


def test_bf16_on_cuda_agrees_with_bf16_on_cpu(tiny):
    path = tiny("qwen3")
    prompts = _prompts(256, [3, 40, 120, 7])
    cuda = _generate(_cuda_llm(path, dtype="bfloat16"), prompts)
    cpu = _generate(LLM(path, device="cpu", dtype="bfloat16"), prompts)
    assert _agreement(cuda, cpu) >= 0.8


def test_prefix_caching_and_ngram_speculation_are_exact(tiny):
    path = tiny("llama")
    rng = random.Random(1)
    shared = [rng.randrange(3, 250) for _ in range(64)]
    loop = [rng.randrange(3, 250) for _ in range(8)] * 6
    prompts = [shared + [7, 8, 9], shared + [10, 11], loop]
    plain = _generate(_cuda_llm(path, enable_prefix_caching=False), prompts)
    cached = _cuda_llm(path, enable_prefix_caching=True)
    first, second = _generate(cached, prompts), _generate(cached, prompts)
    assert [c.token_ids for c in first] == [c.token_ids for c in second] == [c.token_ids for c in plain]
    assert cached.engine.stats().prefix_cache_hits >= 2 * 64
    spec = _cuda_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    assert [c.token_ids for c in _generate(spec, prompts)] == [c.token_ids for c in plain]


def test_fp8_weights_and_fp8_kv_stay_close(tiny):
    """fp8 KV against the unquantized cache (the CPU suite's bound); fp8 weights (torch._scaled_mm on sm_89+,
    fp8 activations too) against the CPU engine's fp8 weights (widened to float)."""
    path = tiny("llama")
    prompts = _prompts(400, seed=5)
    ref = _generate(_cuda_llm(path, num_gpu_blocks_override=24, max_num_batched_tokens=64), prompts)
    fp8_kv = _generate(_cuda_llm(path, kv_cache_dtype="fp8", num_gpu_blocks_override=24,
                                 max_num_batched_tokens=64), prompts)
    assert _agreement(fp8_kv, ref) >= 0.75
    fp8_cuda = _generate(_cuda_llm(path, quantization="fp8"), prompts)
    fp8_cpu = _generate(LLM(path, device="cpu", dtype="float32", quantization="fp8"), prompts)
    assert _agreement(fp8_cuda, fp8_cpu) >= 0.7


def test_host_tier_restores_an_evicted_prefix(tiny):
    path = tiny("llama")
    prompts = _prompts(256, [96, 100, 100, 100], seed=3)
    ref = _generate(_cuda_llm(path, enable_prefix_caching=False), prompts[:1])[0]
    llm = _cuda_llm(path, num_gpu_blocks_override=16, block_size=16, enable_prefix_caching=True,
                    kv_offloading_size=f"{64 * 8192}B")  # 64 blocks of the tiny llama's float32 KV
    for p in prompts:  # the fillers push the first prompt's blocks out of the device pool
        _generate(llm, [p])
    again = _generate(llm, prompts[:1])[0]
    assert again.token_ids == ref.token_ids
    assert llm.engine.scheduler.kv.is_whole()


def test_disaggregated_pull_between_two_cuda_engines(tiny):
    path = tiny("llama")
    from tokenmill.fleet.launchers import free_port

    role = lambda r: {"kv_connector": "TokenmillConnector", "kv_role": r}  # noqa: E731
    port = free_port()
    prefill = _cuda_llm(path, kv_transfer_config={**role("kv_producer"), "kv_port": port})
    decode = _cuda_llm(path, kv_transfer_config={**role("kv_consumer"),  # it pulls from the producer only
                                                 "kv_connector_extra_config": {"allowed_peers": [f"127.0.0.1:{port}"]}})
    prompts = _prompts(256, [17, 40, 70], seed=4)
    ref = _generate(_cuda_llm(path, enable_prefix_caching=False), prompts, SamplingParams(temperature=0,
                                                                                          max_tokens=6,
                                                                                          ignore_eos=True))
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for p, r in zip(prompts, ref):
        pre = prefill.generate([{"prompt_token_ids": p, "kv_transfer_params": {"do_remote_decode": True}}], first,
                               use_tqdm=False)[0]
        out = decode.generate([{"prompt_token_ids": p, "kv_transfer_params": pre.kv_transfer_params}],
                              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == r.token_ids
    assert dict(decode.engine.stats().kv_connector)["kv_pulls"] == len(prompts)
