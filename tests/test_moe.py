"""Mixture-of-experts models (Mixtral, Qwen3-MoE) and layers/fused_moe.py.

- Token for token and logit for logit against transformers (float32), through the engine's hard paths
  (chunked prefill, preemption, prompts of very different lengths), for Mixtral and Qwen3-MoE with
  norm_topk_prob off and on, dense layers from mlp_only_layers and decoder_sparse_step.
- The fused layer against a per-token reference; int8 weight-only experts; expert-load counts.
- Expert parallel (EP=2) and tensor parallel (TP=2, no EP) in real gloo worlds: the layer alone, and the
  whole model's logits vs one process.
- `tokenmill plan`'s parameter count agrees with what the engine allocates.
"""
import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_ranks
from models import MOE_ARCHS, hf_model
from tokenmill import LLM, SamplingParams

PROMPT_LENS = [1, 300, 5, 77, 16, 150, 33, 210]
MAX_TOKENS = 10


def _prompts(vocab: int, lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _hf_reference(path: str, prompts):
    model = hf_model(path)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            refs.append((out.sequences[0, len(p):].tolist(), [s[0].float().log_softmax(-1) for s in out.logits]))
    return refs


def _assert_matches_reference(prompts, outs, refs):
    for p, out, (ref_tokens, ref_lps) in zip(prompts, outs, refs):
        c = out.outputs[0]
        assert c.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        for step, (tok, lp_dict) in enumerate(zip(c.token_ids, c.logprobs)):
            ids = torch.tensor(list(lp_dict))
            ours = torch.tensor([lp.logprob for lp in lp_dict.values()])
            torch.testing.assert_close(ours, ref_lps[step][ids], atol=1e-4, rtol=1e-4)
            assert lp_dict[tok].rank == 1


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_greedy_matches_transformers(tiny, arch):
    path = tiny(arch)
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=64)
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()
    _assert_matches_reference(prompts, outs, _hf_reference(path, prompts))

    model = llm.engine.executor.worker.model
    load = model.expert_load()
    num_moe = sum(1 for layer in model.layers if not hasattr(layer.mlp, "gate_up_proj"))
    assert load.shape == (num_moe, 4) and load.dtype == torch.int64
    # every processed token (prompts, recomputed prefixes after preemption, decodes) is routed to top-2
    assert (load.sum(dim=1) == load[0].sum()).all() and load[0].sum() % 2 == 0
    assert load[0].sum() >= 2 * (sum(PROMPT_LENS) + len(prompts) * (MAX_TOKENS - 1))
    assert (load > 0).all(), "every expert should see tokens"
    assert model.expert_load().sum() == 0, "expert_load() resets the counts"
