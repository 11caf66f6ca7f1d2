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
from moe_models import smollm2_moe
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


def _greedy_vs_transformers(path, **kw):
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=24, block_size=16, max_num_batched_tokens=64, **kw)
    try:
        prompts = _prompts(llm.config.model.hf_config.vocab_size)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0, "the test must exercise preemption"
        _assert_matches_reference(prompts, outs, _hf_reference(path, prompts))
    finally:
        llm.engine.shutdown()
    # the model runner hands each step's model.expert_load() to the engine, which accumulates it
    load = torch.tensor(stats.expert_load)
    assert load.shape[1] == 4
    # every processed token (prompts, recomputed prefixes after preemption, decodes) is routed to top-2
    assert (load.sum(dim=1) == load[0].sum()).all() and load[0].sum() % 2 == 0
    assert load[0].sum() >= 2 * (sum(PROMPT_LENS) + len(prompts) * (MAX_TOKENS - 1))
    assert (load > 0).all(), "every expert should see tokens"
    return llm


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_greedy_matches_transformers(tiny, arch):
    llm = _greedy_vs_transformers(tiny(arch))
    model = llm.engine.executor.collective_rpc(lambda w: w.model)[0]
    assert len(llm.engine.stats().expert_load) == len(model.moe_layers())
    assert model.expert_load().sum() == 0, "expert_load() resets the counts"


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_norm"])
def test_expert_parallel_engine_matches_transformers(tiny, arch):
    """EP=2 through the whole engine (mp executor, two worker processes): still transformers' tokens."""
    _greedy_vs_transformers(tiny(arch), tensor_parallel_size=2, enable_expert_parallel=True)


def test_batch_invariant_mode(tiny):
    """--batch-invariant holds for MoE layers: bit-identical logprobs one prompt at a time or all together
    (the grouping per expert changes with the batch; each token's reductions must not)."""
    from tokenmill.layers import batch_invariant

    prompts = _prompts(400, [1, 3, 17, 40, 65, 9], seed=2)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
    try:
        llm = LLM(tiny("mixtral"), dtype="float32", batch_invariant=True, max_num_batched_tokens=64,
                  num_gpu_blocks_override=64, block_size=16)
        runs = [[o for group in groups for o in llm.generate([{"prompt_token_ids": prompts[i]} for i in group],
                                                              sp, use_tqdm=False)]
                for groups in ([[i] for i in range(len(prompts))], [list(range(len(prompts)))])]
    finally:
        batch_invariant.enable(False)  # process-wide; leave other tests in the default mode
    one, together = ([(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in s.items()] for s in o.outputs[0].logprobs])
                      for o in run] for run in runs)
    assert one == together


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_gguf_moe_loads_like_its_safetensors(tiny, arch, tmp_path, monkeypatch):
    """A MoE GGUF as llama.cpp lays it out (experts stacked per projection, router ffn_gate_inp, Mixtral as
    a 'llama' GGUF with Q/K rows permuted; qwen3_moe with norm_topk_prob off and a dense layer) converts to
    an HF directory whose model gives the safetensors model's tokens and logprobs."""
    import tokenmill.models.gguf as gguf_mod
    from moe_models import tiny_moe_gguf

    monkeypatch.setattr(gguf_mod, "cache_root", lambda: str(tmp_path))  # keep the conversion out of ~/.cache
    converted = gguf_mod.gguf_to_hf_dir(tiny_moe_gguf(tiny(arch), arch))
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in _prompts(400, [7, 60, 1], seed=3)]
    runs = [[o.outputs[0] for o in LLM(path, dtype="float32").generate(prompts, sp, use_tqdm=False)]
            for path in (tiny(arch), converted)]
    for ref, got in zip(*runs):
        assert got.token_ids == ref.token_ids
        for a, b in zip(got.logprobs, ref.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


# -- the fused layer --------------------------------------------------------------------------------------
def _expert_weights(E=8, H=64, I=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, H, generator=g) * 0.5, torch.randn(E, 2 * I, H, generator=g) * 0.1,
            torch.randn(E, H, I, generator=g) * 0.1)


def _layer(weights, k=2, renormalize=True, quant_method=None, dtype=torch.float32):
    from tokenmill.layers.fused_moe import FusedMoE

    gate, w13, w2 = weights
    E, H, I = w2.shape[0], w2.shape[1], w2.shape[2]
    layer = FusedMoE(E, k, H, I, dtype, renormalize=renormalize, quant_method=quant_method)
    layer.gate.weight.data.copy_(gate)
    layer.load_stacked("gate_up_proj", w13.to(dtype))
    layer.load_stacked("down_proj", w2.to(dtype))
    assert layer.experts_loaded()
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _reference(x, weights, k, renormalize):
    """Token by token, pair by pair: the definition, with no grouping at all."""
    gate, w13, w2 = weights
    w, ids = (x @ gate.T).softmax(-1).topk(k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            g, u = (w13[ids[t, j]] @ x[t]).chunk(2)
            out[t] += w[t, j] * (w2[ids[t, j]] @ (F.silu(g) * u))
    return out, ids


@pytest.mark.parametrize("tokens", [1, 7, 200])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_layer_matches_the_definition(tokens, renormalize):
    weights = _expert_weights()
    layer = _layer(weights, k=2, renormalize=renormalize)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x)
    ref, ids = _reference(x, weights, 2, renormalize)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(layer.take_expert_load(), torch.bincount(ids.reshape(-1), minlength=8))
    assert layer.take_expert_load().sum() == 0


def test_fused_layer_matches_transformers_blocks_in_bfloat16():
    """The dtype rules (router logits in the model dtype, softmax in float32; Mixtral scales by float32
    weights, Qwen3-MoE by model-dtype weights) against transformers' own blocks, bf16 tolerance."""
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from tokenmill.layers.fused_moe import FusedMoE

    gate, w13, w2 = _expert_weights(E=4, I=96)
    x = torch.randn(1, 33, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    common = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=96, num_experts_per_tok=2)
    for block, renorm, f32 in [(MixtralSparseMoeBlock(transformers.MixtralConfig(num_local_experts=4, **common)),
                                True, True),
                               (Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(num_experts=4, norm_topk_prob=True,
                                                                                   **common)), True, False)]:
        block = block.to(torch.bfloat16).eval()
        with torch.no_grad():
            block.gate.weight.copy_(gate)
            block.experts.gate_up_proj.copy_(w13)
            block.experts.down_proj.copy_(w2)
            ref = block(x)[0]
        ours = FusedMoE(4, 2, 64, 96, torch.bfloat16, renormalize=renorm, float32_scores=f32)
        ours.gate.weight.data.copy_(gate)
        ours.load_stacked("gate_up_proj", w13.bfloat16())
        ours.load_stacked("down_proj", w2.bfloat16())
        ours.quant_method.process_weights_after_loading(ours)
        with torch.inference_mode():
            y = ours(x[0])
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("tokens", [5, 300])  # the integer kernel (<= 64 rows per expert) and the MKL path
def test_int8_experts(tokens):
    from tokenmill.layers.fused_moe import Int8MoEMethod
    from tokenmill.layers.quantization.int8 import dequantize_int8, quantize_int8

    gate, w13, w2 = _expert_weights()
    layer = _layer((gate, w13, w2), quant_method=Int8MoEMethod())
    assert layer.w13_weight.dtype == torch.int8 and layer.w2_weight.dtype == torch.int8
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        y = layer(x)
    deq = lambda w: torch.stack([dequantize_int8(*quantize_int8(e)) for e in w])  # noqa: E731
    ref_q, _ = _reference(x, (gate, deq(w13), deq(w2)), 2, True)
    ref_f, _ = _reference(x, (gate, w13, w2), 2, True)
    scale = ref_f.abs().max()
    assert (y - ref_q).abs().max() < 1e-3 * scale  # the int8 weights, run exactly (16-bit activation grid)
    err = (y - ref_f).abs().max()
    assert 1e-5 * scale < err < 3e-2 * scale  # and they really are quantized, within int8 error


def test_refusals():
    from tokenmill.layers.fused_moe import FusedMoE

    with pytest.raises(ValueError, match=r"num_experts_per_tok=5 must be in \[1, 4\]"):
        FusedMoE(4, 5, 64, 96, torch.float32, renormalize=True)
    layer = FusedMoE(4, 2, 64, 96, torch.float32, renormalize=True)
    with pytest.raises(ValueError, match=r"expert 1 gate weight has shape \(96, 32\), expected \(96, 64\)"):
        layer.load_expert(1, "gate", torch.zeros(96, 32))
    with pytest.raises(ValueError, match="expert 4 out of range"):
        layer.load_expert(4, "up", torch.zeros(96, 64))


# -- expert parallel and tensor parallel, real gloo worlds ----------------------------------------------------
def _layer_on_rank(tokens: int):
    """Every rank builds the same 8-expert layer from the same full weights; each keeps its share. Also what a
    3-expert layer says on this rank (refused under EP=2)."""
    from tokenmill.layers.fused_moe import FusedMoE

    layer = _layer(_expert_weights())
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        y = layer(x)
    try:
        FusedMoE(3, 2, 64, 96, torch.float32, renormalize=True)
        refusal = None
    except ValueError as e:
        refusal = str(e)
    return y, layer.take_expert_load(), tuple(layer.w13_weight.shape), tuple(layer.w2_weight.shape), refusal


@pytest.mark.distributed
@pytest.mark.parametrize("expert_parallel", [True, False])
def test_layer_sharded_over_two_ranks(expert_parallel):
    """EP=2: each rank holds 4 whole experts; TP=2: each holds every expert's half width. Both sum the
    partial outputs with one all-reduce and equal the single-process layer. 3 experts over EP=2 are refused."""
    ref, ref_load, _, _, _ = _layer_on_rank(37)
    results = run_ranks(_layer_on_rank, 2, 1, 37, expert_parallel=expert_parallel)
    shapes = [((4, 192, 64), (4, 64, 96))] * 2 if expert_parallel else [((8, 96, 64), (8, 64, 48))] * 2
    assert [(r[2], r[3]) for r in results] == shapes
    for y, load, _, _, refusal in results:
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        assert torch.equal(load, ref_load)  # every rank counts all experts' tokens
        if expert_parallel:
            assert "3 experts cannot be split evenly over expert-parallel size 2" in refusal
        else:
            assert refusal is None


# -- tokenmill plan agrees with the engine ----------------------------------------------------------------
def _load(path, dtype=torch.float32):
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    config = AutoConfig.from_pretrained(path)
    return config, load_model(path, config, dtype, "cpu", get_attention_backend("cpu"), 1024)


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_weight_bytes_match_the_loaded_model(tiny, arch, dtype):
    from tokenmill.perf.memory import ModelShape, memory_plan
    from tokenmill.models.shape import load_model_shape

    config, model = _load(tiny(arch), dtype)
    allocated = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = load_model_shape(tiny(arch))  # what `tokenmill plan --model <dir>` reads
    assert shape == ModelShape.from_hf_config(config.to_dict(), name=shape.name)
    assert shape.num_experts == 4 and shape.num_moe_layers == len(model.moe_layers())
    plan = memory_plan(shape, str(dtype), "bf16", 1024, 2**30)
    assert plan.weight_bytes == allocated


def _model_logits(path: str):
    """Logits of a prefill step (4 prompts of varied lengths, all positions) and a decode step after it,
    from the model loaded on this rank (its experts / slices only)."""
    import numpy as np

    from tokenmill.models.flat_batch import block_table_array, flat_batch

    _, model = _load(path)
    bs, lens = 16, [5, 37, 1, 20]
    attn = model.layers[0].self_attn
    blocks = [list(range(sum(-(-(n + 1) // bs) for n in lens[:i]), sum(-(-(n + 1) // bs) for n in lens[:i + 1])))
              for i in range(len(lens))]
    kv = [torch.zeros(2, attn.num_kv_heads, sum(map(len, blocks)), bs, attn.head_dim) for _ in model.layers]
    table = block_table_array(blocks)
    ids = np.concatenate(_prompts(model.config.vocab_size, lens, seed=5)).astype(np.int64)
    out = []
    with torch.inference_mode():
        for qlens, starts in [(np.array(lens), np.zeros(4, dtype=np.int64)), (np.ones(4, dtype=np.int64), np.array(lens))]:
            input_ids, meta, qsl = flat_batch(ids, qlens, starts, table, bs, torch.device("cpu"))
            logits = model.compute_logits(model(input_ids, meta, kv))
            out.append(logits)
            ids = logits[qsl[1:] - 1].argmax(-1).numpy()  # each request's next token
    return out, model.expert_load(), tuple(model.moe_layers()[0].w13_weight.shape)


@pytest.mark.distributed
@pytest.mark.parametrize("arch,expert_parallel", [("mixtral", False), ("qwen3_moe", True)])
def test_model_sharded_over_two_ranks(tiny, arch, expert_parallel):
    """EP=2 (attention TP, experts split) and TP=2 (experts' width split): logits of a prefill and a decode
    step equal the single-process model's within 1e-4, and every rank's expert load is the global one."""
    path = tiny(arch)
    ref, ref_load, full = _model_logits(path)
    results = run_ranks(_model_logits, 2, 1, path, expert_parallel=expert_parallel)
    E, twice_i, H = full
    assert results[0][2] == ((E // 2, twice_i, H) if expert_parallel else (E, twice_i // 2, H))
    for logits, load, _ in results:
        for ours, want in zip(logits, ref):
            torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(load, ref_load)


# -- a real-weights MoE (SmolLM2 split into 4 jittered experts, tests/moe_models.py) ---------------------------
@pytest.fixture(scope="module")
def smollm2_moe_path():
    pytest.importorskip("gguf")
    try:
        return smollm2_moe()
    except RuntimeError as e:  # the default model's package is not installed
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_moe_single(smollm2_moe_path):
    """The single-process engine's greedy answer and expert load."""
    llm = LLM(smollm2_moe_path, dtype="float32", kv_cache_memory_bytes="64MiB")
    model = llm.engine.executor.collective_rpc(lambda w: w.model)[0]
    assert len(model.moe_layers()) == 30 and model.moe_layers()[0].w13_weight.shape == (4, 2 * 1536, 576)
    out = llm.generate(PARIS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    load = torch.tensor(llm.engine.stats().expert_load)
    llm.engine.shutdown()
    return out, load


PARIS = "The capital of France is"


def test_smollm2_moe_is_coherent(smollm2_moe_single):
    out, load = smollm2_moe_single
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text
    assert (load.sum(dim=1) == 2 * (len(out.prompt_token_ids) + 11)).all()
    assert (load > 0).sum() > 0.75 * load.numel(), "the random router spreads tokens over the experts"


@pytest.mark.distributed
def test_smollm2_moe_is_coherent_under_expert_parallel(smollm2_moe_path, smollm2_moe_single):
    """EP=2 on a model whose 9 heads do not divide 2 ranks: attention runs replicated, each rank holds 2 of
    the 4 experts of every layer, and the tokens and expert load are the single-process engine's."""
    llm = LLM(smollm2_moe_path, dtype="float32", kv_cache_memory_bytes="64MiB", tensor_parallel_size=2,
              enable_expert_parallel=True)
    try:
        out = llm.generate(PARIS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
        load = torch.tensor(llm.engine.stats().expert_load)
    finally:
        llm.engine.shutdown()
    single, single_load = smollm2_moe_single
    assert out.outputs[0].text.startswith(" Paris"), out.outputs[0].text
    assert out.outputs[0].token_ids == single.outputs[0].token_ids
    assert torch.equal(load, single_load)


def test_online_int8_reaches_the_experts(tiny, caplog):
    """--quantization int8 quantizes the experts too (the router stays float); w8a8 says it leaves them."""
    from tokenmill.layers.fused_moe import Int8MoEMethod

    llm = LLM(tiny("mixtral"), dtype="float32", quantization="int8")
    moes = llm.engine.executor.collective_rpc(_fused_moe_layers)[0]
    assert moes and all(kind == Int8MoEMethod.__name__ and dtype == "torch.int8" for kind, dtype in moes)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=6,
                                                                           ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    with caplog.at_level("WARNING", logger="tokenmill"):
        LLM(tiny("mixtral"), dtype="float32", quantization="w8a8")
    assert "does not cover MoE experts" in caplog.text


def _fused_moe_layers(worker):
    from tokenmill.layers.fused_moe import FusedMoE

    return [(type(m.quant_method).__name__, str(m.w13_weight.dtype)) for m in worker.model.modules()
            if isinstance(m, FusedMoE)]
