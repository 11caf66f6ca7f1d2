"""Gemma 3 (text) against transformers, float32: the tiny random model of tests/models.py (GEMMA_ARCHS: local and
global layers, a sliding window shorter than the prompts, distinct rope bases, query_pre_attn_scalar != head_dim,
head_dim != hidden / heads, randomized (1 + w) norms) through the engine (chunked prefill, preemption, a prefix
cache hit, TP=2), and the same model as a GGUF written with llama.cpp's conventions (tests/gguf_models.py)."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from models import hf_model
from test_model_exactness import MAX_TOKENS, _hf_reference, _prompts
from test_parallel_engine import _check_plan_agrees
from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _assert_matches(outs, refs) -> None:
    """Greedy tokens equal, each step's top-5 logprobs within 1e-4 of the reference's."""
    for out, (ref_tokens, ref_lps) in zip(outs, refs):
        c = out.outputs[0]
        assert c.token_ids == ref_tokens, f"prompt of {len(out.prompt_token_ids)} tokens diverged"
        for step, lp_dict in enumerate(c.logprobs):
            ids = torch.tensor(list(lp_dict))
            ours = torch.tensor([lp.logprob for lp in lp_dict.values()])
            torch.testing.assert_close(ours, ref_lps[step][ids], atol=1e-4, rtol=1e-4)


def _variant(src: str, dst: str, **changes) -> str:
    """A copy of a model directory with config.json fields changed."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_greedy_matches_transformers_with_chunking_and_preemption(tiny):
    path = tiny("gemma3")
    # test_model_exactness's setting: prompts of 1..300 tokens (the window is 24) in 64-token steps, and a cache
    # too small for ~800 tokens of work, so preemption is certain: 40 blocks of 16 tokens and one layer slot (KV
    # groups: the local layers give back what leaves their window, so 24 blocks of all 3 layers no longer preempt)
    kernels = check_chunked_preempted_matches_transformers(path)
    assert kernels["decoder_stack"].startswith("off: Gemma 3 layers")


def check_chunked_preempted_matches_transformers(path: str) -> dict:
    """Prompts of 1..300 tokens in 64-token steps, 40 blocks of 16 tokens for ~800 tokens of work (preemption is
    certain): greedy tokens and logprobs match transformers, the pool is whole after. Returns the kernels report
    (test_deepseek and test_gpt_oss use it too)."""
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=40, block_size=16, max_num_batched_tokens=64)
    prompts = _prompts(llm.config.model.hf_config.vocab_size)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()
    _assert_matches(outs, _hf_reference(path, prompts))
    return llm.engine.executor.kernels()


def test_prefix_cache_hit_matches_transformers(tiny):
    check_prefix_hit_matches_transformers(tiny("gemma3"))


def check_prefix_hit_matches_transformers(path: str) -> None:
    """The same 100-token prompt twice: the second run reads most of it from cached blocks (past a sliding window
    where the model has one); both match transformers (test_deepseek and test_gpt_oss use it too)."""
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=32, num_gpu_blocks_override=64)
    prompt = _prompts(400)[1][:100]
    ref = _hf_reference(path, [prompt])
    first = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens >= 96
    _assert_matches(first, ref)
    _assert_matches(second, ref)


def test_final_logit_softcapping_matches_transformers(tiny, tmp_path):
    path = _variant(tiny("gemma3"), str(tmp_path / "softcap"), final_logit_softcapping=2.0)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    prompts = _prompts(400)[:3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    refs = _hf_reference(path, prompts)
    _assert_matches(outs, refs)
    uncapped = _hf_reference(tiny("gemma3"), prompts[:1])[0][1][0]
    assert (uncapped - refs[0][1][0]).abs().max() > 0.1  # the cap changes these distributions


@pytest.mark.parametrize("field, value, message", [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0 is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
])
def test_unsupported_variants_are_refused(tiny, field, value, message):
    from tokenmill.models.gemma3 import Gemma3ForCausalLM

    check_refused(tiny("gemma3"), Gemma3ForCausalLM, field, value, message)


def check_refused(model_dir: str, model_cls, field: str, value, message: str) -> None:
    """The tiny model's config with `field` set to `value`: building the model refuses it in one line."""
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend

    config = AutoConfig.from_pretrained(model_dir)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message) as info:
        model_cls(config, torch.float32, get_attention_backend("cpu"), 64)
    assert "\n" not in str(info.value)


def test_older_config_json_matches_transformers(tiny, tmp_path):
    """A config.json in the pre-transformers-5 form (sliding_window_pattern instead of layer_types,
    rope_theta + rope_local_base_freq + rope_scaling instead of rope_parameters), here describing the same
    model: the engine on it gives the new form's reference tokens and logprobs."""
    src = tiny("gemma3")
    dst = str(tmp_path / "old")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        config.pop(key, None)
    # sliding_window_pattern 2: local, global, local, as the model's layer_types
    config.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=10000.0,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    prompts = _prompts(400)[:4]
    llm = LLM(dst, dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    _assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False),
                    _hf_reference(src, prompts))


def test_older_config_forms_give_the_same_rope():
    """rope_local_base_freq + rope_theta + rope_scaling (global layers only), as configs before transformers 5
    spell it, give each layer type the tables of the nested rope_parameters form."""
    from tokenmill.layers.rotary import compute_inv_freq, rope_layer_type

    layer_types = ["sliding_attention", "full_attention"]
    new = SimpleNamespace(layer_types=layer_types, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    old = SimpleNamespace(layer_types=layer_types, rope_theta=1e6, rope_local_base_freq=10000.0,
                          rope_scaling={"rope_type": "linear", "factor": 8.0})
    for i, kind in enumerate(layer_types):
        assert rope_layer_type(new, i) == rope_layer_type(old, i) == kind
        torch.testing.assert_close(compute_inv_freq(new, 32, kind), compute_inv_freq(old, 32, kind), rtol=0, atol=0)
    local, full = compute_inv_freq(new, 32, "sliding_attention")[0], compute_inv_freq(new, 32, "full_attention")[0]
    assert local[1] != full[1] and local[0] == 1.0 and full[0] == 1.0 / 8
    assert rope_layer_type(SimpleNamespace(layer_types=layer_types, rope_parameters={"rope_theta": 1e4}), 0) is None


@pytest.mark.distributed
def test_tensor_parallel_matches_one_rank(tiny):
    """TP=2 (mp executor: 4 query heads, 2 KV heads split over the ranks) gives TP=1's tokens and logprobs."""
    prompts = [p[:40] for p in _prompts(400)[1:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = []
    for tp in (1, 2):
        llm = LLM(tiny("gemma3"), dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=16, seed=0,
                  kv_cache_memory_bytes=64 << 20)
        try:
            _check_plan_agrees(llm)  # each rank's weights (four norms a layer, q/k norms) and KV per token
            results.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                                 use_tqdm=False)])
        finally:
            llm.engine.shutdown()
    for one, two in zip(*results):
        assert one.token_ids == two.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_plan_preset_counts_what_transformers_builds():
    """tokenmill plan's Gemma-3-27B: the parameters of transformers' own model of that config (built on the meta
    device), and a token's KV bytes in every layer (a sequence's count the local layers only up to the window:
    tests/test_kv_groups.py)."""
    import transformers

    from tokenmill.models.shape import load_model_shape
    from tokenmill.perf.memory import PRESETS

    shape = load_model_shape("google/gemma-3-27b-it")
    fields = {k: v for k, v in PRESETS["Gemma-3-27B"].items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**fields))
    assert shape.params_total == sum(p.numel() for p in model.parameters())
    assert shape.kv_bytes_per_token("bf16") == 2 * 62 * 16 * 128 * 2


# -- GGUF ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_files(tiny, tmp_path_factory):
    """The tiny model as F32 and Q8_0 GGUFs. A GGUF has no query_pre_attn_scalar (llama.cpp derives the scale:
    head_dim here), so they are written from a copy of the model with query_pre_attn_scalar = head_dim."""
    from gguf_models import gemma3_gguf

    src = tiny("gemma3")
    with open(os.path.join(src, "config.json")) as f:
        head_dim = json.load(f)["head_dim"]
    hf_dir = _variant(src, str(tmp_path_factory.mktemp("gemma3") / "hf"), query_pre_attn_scalar=head_dim)
    return {"hf": hf_dir, "F32": gemma3_gguf(hf_dir, "F32"), "Q8_0": gemma3_gguf(hf_dir, "Q8_0")}


def test_gguf_config_follows_llama_cpp(gguf_files):
    from tokenmill.models.gguf import _hf_config, read_config

    config = read_config(gguf_files["F32"])
    with open(os.path.join(gguf_files["hf"], "config.json")) as f:
        hf = json.load(f)
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "rms_norm_eps",
                "hidden_activation", "tie_word_embeddings", "vocab_size", "num_key_value_heads"):
        assert config[key] == hf[key], key
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert config["rope_parameters"] == {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    # Without a pattern key llama.cpp takes five local layers to one global, and without freq_base_swa a local
    # base of 10000; the 62-layer 27B scales attention by 1/sqrt(hidden / heads), the others by 1/sqrt(head_dim).
    meta = {"gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32, "gemma3.feed_forward_length": 21504,
            "gemma3.block_count": 62, "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
            "gemma3.attention.sliding_window": 1024, "gemma3.rope.freq_base": 1e6}
    config = _hf_config("x.gguf", "gemma3", meta, {"token_embd.weight": (262144, 5376)})
    assert config["layer_types"][:7] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (168, 1024)
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    meta.update({"gemma3.block_count": 26, "gemma3.attention.key_length": 256, "gemma3.attention.sliding_window": 0})
    config = _hf_config("x.gguf", "gemma3", meta, {"token_embd.weight": (262144, 5376)})
    assert config["query_pre_attn_scalar"] == 256 and set(config["layer_types"]) == {"full_attention"}


@pytest.mark.parametrize("ggml_type", ["F32", "Q8_0"])
def test_gguf_dequantized_matches_transformers(gguf_files, ggml_type):
    """--gguf-weights dequantize: the converted folder holds what transformers' own GGUF reader makes of the
    file (Gemma's norms less llama.cpp's 1), and the engine on it matches transformers on that folder (F32: the
    original model's weights), prompts longer than the window included."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tokenmill.models.gguf import gguf_to_hf_dir

    path = gguf_files[ggml_type]
    converted = gguf_to_hf_dir(path, "dequantize")
    model = hf_model(converted)
    stand_in = SimpleNamespace(config=model.config, state_dict=model.state_dict, named_children=lambda: iter(()))
    reference = load_gguf_checkpoint(path, return_tensors=True, model_to_load=stand_in)["tensors"]
    ours = model.state_dict()
    assert set(reference) == set(ours) - {"lm_head.weight"}
    assert all(torch.equal(reference[k].float(), ours[k]) for k in reference)
    if ggml_type == "F32":
        original = hf_model(gguf_files["hf"]).state_dict()
        assert all(torch.allclose(ours[k], original[k], rtol=0, atol=1e-7) for k in original)

    prompts = [p[:60] for p in _prompts(400)[:4]]
    llm = LLM(path, dtype="float32", gguf_weights="dequantize", max_num_batched_tokens=32,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    _assert_matches(outs, _hf_reference(converted, prompts))


def test_gguf_native_follows_the_dequantized_path(gguf_files):
    """Q8_0 served in its blocks: the block kernels round activations to 8 bits, so the greedy tokens must agree
    with the dequantized path up to the first divergence on most positions (tests/test_gguf_native.py)."""
    prompts = [{"prompt_token_ids": p[:60]} for p in _prompts(400)[:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for mode in ("native", "dequantize"):
        llm = LLM(gguf_files["Q8_0"], dtype="float32", gguf_weights=mode, kv_cache_memory_bytes=64 << 20)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if mode == "native":
            assert "ggml" in llm.engine.executor.kernels()["linear"]
    agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
                for a, b in zip(tokens["native"], tokens["dequantize"]))
    assert agree >= 0.75 * sum(len(b) for b in tokens["dequantize"]), tokens
