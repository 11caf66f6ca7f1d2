"""Every architecture, token for token and logit for logit against transformers (float32), through the
hard paths at once: very different prompt lengths in one batch, chunked prefill, and preemption."""
import pytest
import torch

from models import ARCHS, hf_model
from tokenmill import LLM, SamplingParams

PROMPT_LENS = [1, 300, 5, 77, 16, 150, 33, 210]
MAX_TOKENS = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_reference(path: str, prompts):
    model = hf_model(path)
    refs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            tokens = out.sequences[0, len(p):].tolist()
            logprobs = [step[0].float().log_softmax(-1) for step in out.logits]
            refs.append((tokens, logprobs))
    return refs


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_matches_transformers(tiny, arch):
    path = tiny(arch)
    # 24 blocks x 16 = 384 tokens of KV for ~800 tokens of work: preemption is certain; 64-token steps
    # split every long prompt into chunks.
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=64)
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()

    refs = _hf_reference(path, prompts)
    for p, out, (ref_tokens, ref_lps) in zip(prompts, outs, refs):
        c = out.outputs[0]
        assert c.token_ids == ref_tokens, f"prompt of {len(p)} tokens diverged"
        assert c.finish_reason == "length"
        for step, (tok, lp_dict) in enumerate(zip(c.token_ids, c.logprobs)):
            ref = ref_lps[step]
            ids = torch.tensor(list(lp_dict))
            ours = torch.tensor([lp.logprob for lp in lp_dict.values()])
            torch.testing.assert_close(ours, ref[ids], atol=1e-4, rtol=1e-4)
            top5 = ref.topk(5).indices.tolist()
            assert set(top5) <= set(lp_dict), "top-5 ids differ from the reference"
            assert lp_dict[tok].rank == 1
