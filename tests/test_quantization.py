"""Weight quantization: format round trips, kernels against references, tiny models end to end, the exporter.

Formats: int8 (weight-only), w8a8, fp8 (E4M3, per channel; block-scaled checkpoints), mxfp4, nvfp4.
"""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import batch_invariant
from tokenmill.layers.quantization import fp4_codec, fp8, get_quant_config, int8, kernels
from tokenmill.layers.quantization.fp4 import Fp4LinearMethod
from tokenmill.layers.quantization.fp8 import Fp8LinearMethod
from tokenmill.layers.quantization.int8 import Int8LinearMethod
from tokenmill.models.resolution import resolve_engine_config

HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))
METHODS = ["int8", "w8a8", "fp8", "mxfp4", "nvfp4"]


def _method(name):
    return {"int8": lambda: Int8LinearMethod(False), "w8a8": lambda: Int8LinearMethod(True),
            "fp8": lambda: Fp8LinearMethod(), "mxfp4": lambda: Fp4LinearMethod("mxfp4"),
            "nvfp4": lambda: Fp4LinearMethod("nvfp4")}[name]()


class _Layer(nn.Module):
    def __init__(self, w, method):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.weight = nn.Parameter(w.clone(), requires_grad=False)
        self.quant_method = method
        method.process_weights_after_loading(self)

    def forward(self, x, bias=None):
        return self.quant_method.apply(self, x, bias)


# -- round trips: exact on representable values -------------------------------------------------------------
def test_int8_round_trip_exact():
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    q[:, 0] = 127  # every row reaches the grid's end, so its scale is exactly the one used
    scale = torch.rand(16) + 0.5
    q2, s2 = int8.quantize_int8(int8.dequantize_int8(q, scale))
    assert torch.equal(q2, q)
    torch.testing.assert_close(s2, scale, rtol=1e-6, atol=0)


def test_fp8_round_trip_exact_all_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaNs
    values = codes.view(torch.float8_e4m3fn).float()
    w = torch.cat([values, torch.tensor([448.0, -448.0])]).reshape(2, -1) * 0.25
    q, scale = fp8.quantize_fp8(w)
    torch.testing.assert_close(scale, torch.full((2,), 0.25))
    assert torch.equal(fp8.dequantize_fp8(q, scale), w)
    if HAS_CC:  # the kernel's bit-level E4M3 decode agrees with torch on every code
        got = kernels.dequantize(kernels.QFMT_FP8, q.view(torch.uint8), None, scale, w.shape[1])
        assert torch.equal(got, w)


def test_fp8_block_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 200, generator=g)
    q, scale = fp8.quantize_fp8(w, (32, 64))
    assert scale.shape == (3, 4)
    d = fp8.dequantize_fp8(q, scale, (32, 64))
    q2, s2 = fp8.quantize_fp8(d, (32, 64))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)


def test_e2m1_codes_and_nibbles_round_trip():
    codes = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)  # 8 is -0
    assert torch.equal(fp4_codec.e2m1_encode(fp4_codec.e2m1_decode(codes)), codes)
    # ties round to the even mantissa: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; saturate at 6
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -100.0])
    assert fp4_codec.e2m1_decode(fp4_codec.e2m1_encode(v)).tolist() == [0, 1, 1, 2, 2, 4, 4, 6, -6]
    packed = torch.randint(0, 256, (5, 12), dtype=torch.uint8)
    assert torch.equal(fp4_codec.pack_nibbles(fp4_codec.unpack_nibbles(packed)), packed)


def _e2m1_values(shape, g):
    v = fp4_codec.e2m1_lut()[torch.randint(0, 16, shape, generator=g)]
    v[..., 0] = 6.0  # every block reaches the top of the grid
    return v


def test_mxfp4_round_trip_exact():
    g = torch.Generator().manual_seed(1)
    vals = _e2m1_values((8, 4, 32), g)
    exps = torch.randint(-8, 4, (8, 4, 1), generator=g).float()
    w = (vals * torch.exp2(exps)).reshape(8, 128)
    packed, scales = fp4_codec.quantize_mxfp4(w)
    assert packed.shape == (8, 64) and scales.shape == (8, 4) and packed.dtype == torch.uint8
    assert torch.equal(fp4_codec.dequantize_mxfp4(packed, scales), w)
    if HAS_CC:
        assert torch.equal(kernels.dequantize(kernels.QFMT_MXFP4, packed, scales, None, 128, 32), w)


def test_nvfp4_round_trip_exact():
    g = torch.Generator().manual_seed(2)
    vals = _e2m1_values((8, 4, 16), g)
    block_scales = torch.randint(0x30, 0x70, (8, 4, 1), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    block_scales = block_scales.float()
    block_scales[0, 0, 0] = 448.0  # the tensor's max block uses the top E4M3 scale
    g0 = 2.0 ** -10
    w = (vals * block_scales * g0).reshape(8, 64)
    packed, scales, global_scale = fp4_codec.quantize_nvfp4(w)
    assert global_scale == g0 and packed.shape == (8, 32) and scales.shape == (8, 4)
    assert torch.equal(fp4_codec.dequantize_nvfp4(packed, scales, global_scale), w)
    if HAS_CC:
        assert torch.equal(kernels.dequantize(kernels.QFMT_NVFP4, packed, scales, None, 64, 16, global_scale), w)


# -- quantized linear layers --------------------------------------------------------------------------------
# relative error of y = x W^T against float W (random Gaussian weights and inputs)
ERROR_BOUND = {"int8": 0.02, "w8a8": 0.03, "fp8": 0.06, "mxfp4": 0.2, "nvfp4": 0.15}


@pytest.mark.parametrize("name", METHODS)
def test_quantized_linear_error_bound_and_kernel_paths(name):
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(72, 160, generator=g), torch.randn(72, generator=g)
    layer = _Layer(w, _method(name))
    assert layer.weight.dtype in (torch.int8, torch.uint8)
    deq = layer.quant_method.dequantized_weight(layer)
    with torch.inference_mode():
        for M in (1, 2, 3, 5, 70):  # fused decode path, L1-buffered path, widened-weights GEMM path
            x = torch.randn(M, 160, generator=g)
            y = layer(x, b)
            ref = F.linear(x, w, b)
            assert (y - ref).norm() / ref.norm() < ERROR_BOUND[name], (name, M)
            if name == "w8a8":  # exact integer products: compare with the quantized activations
                xq, xs = kernels.quantize_rows(x, kernels.ACT_QMAX_W8A8)
                exact = (xq.double() @ layer.weight.double().t()) * xs.double()[:, None] \
                    * layer.weight_row_scale.double() + b.double()
                torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-4)
            else:  # the kernels compute x @ dequantized(W)^T (int8's 16-bit activation grid: ~3e-5)
                torch.testing.assert_close(y, F.linear(x, deq, b), rtol=1e-4, atol=1e-3)
        xb = torch.randn(2, 3, 160, generator=g).bfloat16()  # leading dims and bf16 activations
        yb = layer(xb)
        assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, 72)
        ref = F.linear(xb.float(), deq)
        assert (yb.float() - ref).norm() / ref.norm() < 0.02


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
@pytest.mark.parametrize("name", METHODS)
def test_batch_invariant_rows(name):
    g = torch.Generator().manual_seed(4)
    layer = _Layer(torch.randn(40, 96, generator=g), _method(name))
    x = torch.randn(70, 96, generator=g)
    batch_invariant.enable(True)
    try:
        with torch.inference_mode():
            full = layer(x)
            for i in (0, 1, 69):
                assert torch.equal(layer(x[i:i + 1])[0], full[i]), (name, i)
            assert torch.equal(layer(x[3:5]), full[3:5])
    finally:
        batch_invariant.enable(False)


def test_weight_memory_shrinks():
    w = torch.randn(256, 512)
    sizes = {}
    for name in METHODS:
        layer = _Layer(w, _method(name))
        sizes[name] = sum(p.numel() * p.element_size() for p in layer.parameters())
    fp32 = w.numel() * 4
    assert sizes["int8"] < 0.26 * fp32 and sizes["w8a8"] < 0.26 * fp32 and sizes["fp8"] < 0.26 * fp32
    assert sizes["mxfp4"] < 0.14 * fp32 and sizes["nvfp4"] < 0.15 * fp32


def test_fp4_needs_block_multiple():
    cfg = get_quant_config("mxfp4")
    layer = nn.Module()
    layer.in_features = 48
    with pytest.raises(ValueError, match="multiples of 32"):
        cfg.get_linear_method(layer, "layers.0.mlp.down_proj", [])


# -- models end to end -------------------------------------------------------------------------------------
# teacher-forced top-1 agreement with the unquantized model on the tiny random models (flat distributions:
# a hard case; real models agree far more, see `tokenmill eval quality`)
AGREEMENT = {"int8": 0.9, "w8a8": 0.85, "fp8": 0.7, "mxfp4": 0.35, "nvfp4": 0.45}


@pytest.fixture(scope="module")
def llama_quality(tiny):
    from tokenmill.eval.quality import evaluate

    return evaluate(tiny("llama"), METHODS, max_tokens=300, window=100, quantize_lm_head="both")


def test_tiny_model_top1_agreement(llama_quality):
    ref, *quant = llama_quality
    assert ref.tokens > 250
    for res in quant:
        d = res.as_dict(ref)
        assert d["top1_agreement"] >= AGREEMENT[res.quantization], d
        assert d["kl_divergence"] < 0.1, d
        if not res.quantize_lm_head:  # the tied head stays the float embedding: every other byte shrank
            assert res.weight_bytes < ref.weight_bytes, d


def test_quality_table_lists_every_method_with_and_without_the_head(llama_quality):
    from tokenmill.eval.quality import format_table

    names = [r.name for r in llama_quality]
    assert names == ["reference"] + [n for m in METHODS for n in (m, m + "+lm_head")]
    table = format_table(llama_quality)
    for name in names:
        assert name in table
    assert "top-1 agreement" in table and "perplexity" in table and "KL" in table and "--quantize-lm-head" in table
    ref, by_name = llama_quality[0], {r.name: r for r in llama_quality}
    for m in METHODS:  # two different models: the quantized head changes the logits
        plain, head = by_name[m].as_dict(ref), by_name[m + "+lm_head"].as_dict(ref)
        assert not plain["quantize_lm_head"] and head["quantize_lm_head"]
        assert plain["kl_divergence"] != head["kl_divergence"], (plain, head)


def _scorer(model, quantization=None, quantize_lm_head=False):
    from tokenmill.config import EngineConfig
    from tokenmill.eval.quality import _Scorer

    cfg = resolve_engine_config(EngineConfig.from_kwargs(
        model=model, quantization=quantization, quantize_lm_head=quantize_lm_head, max_model_len=64,
        kv_cache_memory_bytes=2**24))
    return _Scorer(cfg)


TOKENS = list(range(5, 45))


@torch.inference_mode()
def _final_hidden(scorer, ids):
    """The hidden states the LM head reads (what _Scorer.logprobs feeds compute_logits)."""
    import numpy as np

    from tokenmill.models.flat_batch import flat_batch

    L, bs = len(ids), scorer.block_size
    table = np.arange(-(-L // bs), dtype=np.int64)[None, :]
    input_ids, meta, _ = flat_batch(np.asarray(ids, dtype=np.int64), np.array([L]), np.array([0]), table, bs, "cpu")
    return scorer.worker.model(input_ids, meta, scorer.worker.runner.kv_caches)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied and untied heads
@pytest.mark.parametrize("name", METHODS)
def test_online_quantization_leaves_lm_head_in_model_dtype(tiny, arch, name):
    from tokenmill.layers import cpu_linear
    from tokenmill.layers.linear import LinearBase, UnquantizedLinearMethod

    scorer = _scorer(tiny(arch), name)
    model = scorer.worker.model
    head = model.lm_head
    assert type(head.quant_method) is UnquantizedLinearMethod and head.weight.dtype == torch.float32
    if cpu_linear.packable(head.weight):  # the float head keeps the CPU packed fast path
        assert head.packed_weight is not None
    assert model.tie_word_embeddings == (arch == "llama")
    if model.tie_word_embeddings:
        assert head.weight is model.embed_tokens.weight
    others = [m for m in model.modules() if isinstance(m, LinearBase) and m is not head]
    assert len(others) == 8 and all(not isinstance(m.quant_method, UnquantizedLinearMethod) for m in others)
    ref = _scorer(tiny(arch)).worker.model
    hidden = _final_hidden(scorer, TOKENS)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        assert torch.equal(logits, ref.compute_logits(hidden))
        torch.testing.assert_close(logits, F.linear(hidden, ref.lm_head.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantize_lm_head_flag_quantizes_the_head(tiny, arch):
    from tokenmill.layers.linear import LinearBase

    model = _scorer(tiny(arch), "int8", quantize_lm_head=True).worker.model
    assert model.tie_word_embeddings == (arch == "llama")
    # tied: the head gets its own int8 copy, the embedding keeps its float one for the gather
    assert model.lm_head.weight.dtype == torch.int8 and model.embed_tokens.weight.dtype == torch.float32
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert all(isinstance(m.quant_method, Int8LinearMethod) for m in linears) and len(linears) == 9


def test_quantize_lm_head_cli_flag():
    import argparse

    from tokenmill.config import EngineConfig

    p = argparse.ArgumentParser()
    EngineConfig.add_cli_args(p)
    assert EngineConfig.from_cli_args(p.parse_args(["--quantization", "int8"])).model.quantize_lm_head is False
    on = EngineConfig.from_cli_args(p.parse_args(["--quantization", "int8", "--quantize-lm-head"]))
    assert on.model.quantize_lm_head is True and on.model.quantization == "int8"
    assert "default: off" in p.format_help()


def test_quantize_lm_head_without_online_quantization_warns(tiny, caplog):
    import logging

    from tokenmill.layers.linear import UnquantizedLinearMethod

    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        model = _scorer(tiny("llama"), None, quantize_lm_head=True).worker.model
    assert type(model.lm_head.quant_method) is UnquantizedLinearMethod
    assert any("--quantize-lm-head has no effect" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # tied and untied heads
def test_greedy_generation_with_and_without_quantized_head(tiny, arch):
    from tokenmill import LLM, SamplingParams
    from tokenmill.layers.linear import UnquantizedLinearMethod

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 40))}]
    outs = {}
    for head in (False, True):
        llm = LLM(tiny(arch), quantization="int8", quantize_lm_head=head, kv_cache_memory_bytes=2**22,
                  block_size=4, max_num_seqs=2)
        lm_head = llm.engine.executor.collective_rpc(lambda w: w.model.lm_head)[0]
        assert isinstance(lm_head.quant_method, Int8LinearMethod if head else UnquantizedLinearMethod)
        outs[head] = llm.generate(prompt * 2, sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in outs[head])
        assert outs[head][0].outputs[0].token_ids == outs[head][1].outputs[0].token_ids


@pytest.mark.parametrize("method,keep_lm_head", [("fp8", False), ("int8", False), ("w8a8", False), ("fp8", True)])
def test_exporter_loader_round_trip(tiny, tmp_path, method, keep_lm_head):
    from tokenmill.models.export import export_quantized

    src = tiny("qwen2")  # untied head, q/k/v biases
    out = export_quantized(src, str(tmp_path / method), method, keep_lm_head=keep_lm_head)
    loaded = _scorer(out)
    assert loaded.worker.model.layers[0].self_attn.qkv_proj.weight.dtype in (torch.int8, torch.uint8)
    # the exporter quantizes the head unless --keep-lm-head: online that is --quantize-lm-head
    online = _scorer(src, method, quantize_lm_head=not keep_lm_head)
    assert torch.equal(loaded.logprobs(TOKENS), online.logprobs(TOKENS))  # same tensors, same kernels


def test_exporter_tied_head_and_block_fp8_format(tiny, tmp_path):
    import json

    from safetensors import safe_open

    from tokenmill.models.export import export_quantized

    out = export_quantized(tiny("llama"), str(tmp_path / "blk"), "fp8", "fp8", block=(32, 32))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"]["quant_method"] == "fp8" and cfg["tie_word_embeddings"] is False
    assert cfg["quantization_config"]["weight_block_size"] == [32, 32]
    scorer = _scorer(out)
    model = scorer.worker.model
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        parts = [fp8.dequantize_fp8(f.get_tensor(f"model.layers.0.self_attn.{p}.weight"),
                                    f.get_tensor(f"model.layers.0.self_attn.{p}.weight_scale_inv"), (32, 32))
                 for p in ("q_proj", "k_proj", "v_proj")]
        head = fp8.dequantize_fp8(f.get_tensor("lm_head.weight"), f.get_tensor("lm_head.weight_scale_inv"), (32, 32))
    qkv = model.layers[0].self_attn.qkv_proj
    assert torch.equal(qkv.quant_method.dequantized_weight(qkv), torch.cat(parts))
    assert torch.equal(model.lm_head.quant_method.dequantized_weight(model.lm_head), head)
    lp, ref = scorer.logprobs(TOKENS), _scorer(tiny("llama")).logprobs(TOKENS)
    assert (lp.argmax(-1) == ref.argmax(-1)).float().mean() > 0.6


def test_engine_generates_with_quantization_chunked_and_prefix_cached(tiny):
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny("mistral"), quantization="int8", max_num_batched_tokens=16, kv_cache_memory_bytes=2**22,
              block_size=4, max_num_seqs=4)
    prompt = list(range(10, 60))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}] * 3, sp, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)  # prefix-cache hit
    assert all(o.outputs[0].token_ids == first[0].outputs[0].token_ids for o in first + again)
    assert len(first[0].outputs[0].token_ids) == 8


# -- configuration errors ----------------------------------------------------------------------------------
def test_config_errors(tiny, tmp_path):
    import json

    from tokenmill.config import EngineConfig

    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        resolve_engine_config(EngineConfig.from_kwargs(model=tiny("llama"), quantization="int3"))
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        resolve_engine_config(EngineConfig.from_kwargs(model=tiny("llama"), quantization="compressed-tensors"))
    awq = tmp_path / "awq"
    shutil.copytree(tiny("llama"), awq)
    with open(awq / "config.json") as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    with open(awq / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="quantized with 'bitsandbytes', which tokenmill cannot load"):
        resolve_engine_config(EngineConfig.from_kwargs(model=str(awq)))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with open(awq / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="already quantized \\(fp8\\); --quantization int8 cannot"):
        resolve_engine_config(EngineConfig.from_kwargs(model=str(awq), quantization="int8"))
    assert resolve_engine_config(EngineConfig.from_kwargs(model=str(awq), quantization="fp8")).model.quantization == "fp8"


def test_cli_quantize_and_eval_quality(tiny, tmp_path, capsys):
    import json

    from tokenmill.cli import main

    out = str(tmp_path / "q8")
    assert main(["quantize", tiny("qwen3"), "--method", "fp8", "--out", out]) == 0
    data = tmp_path / "text.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. Paged attention stores keys and values. " * 4)
    report = tmp_path / "quality.json"
    assert main(["eval", "quality", tiny("qwen3"), "--quantization", "int8,nvfp4", "--dataset", str(data),
                 "--window", "64", "--json", str(report)]) == 0
    table = capsys.readouterr().out
    assert "reference" in table and "int8" in table and "nvfp4+lm_head" in table and "top-1 agreement" in table
    rows = json.loads(report.read_text())  # by default each method with the head in float and quantized
    assert [r["name"] for r in rows] == ["reference", "int8", "int8+lm_head", "nvfp4", "nvfp4+lm_head"]
    assert [r["quantize_lm_head"] for r in rows] == [False, False, True, False, True]
    assert rows[1]["top1_agreement"] > 0.8
    assert main(["eval", "quality", tiny("qwen3"), "--quantization", "fp8", "--dataset", str(data),
                 "--window", "64", "--quantize-lm-head", "no", "--json", str(report)]) == 0
    assert [r["name"] for r in json.loads(report.read_text())] == ["reference", "fp8"]
    capsys.readouterr()
    assert main(["quantize", tiny("qwen3"), "--method", "mxfp4", "--out", str(tmp_path / "x")]) == 2
    assert "mxfp4/nvfp4 quantize on load only" in capsys.readouterr().err


# -- CUDA -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", METHODS)
def test_cuda_quantized_linear(name):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(256, 512, generator=g)
    layer = _Layer(w.cuda(), _method(name))
    x = torch.randn(32, 512, generator=g).cuda().bfloat16()
    with torch.inference_mode():
        y = layer(x).float()
    ref = F.linear(x.float(), w.cuda())
    assert (y - ref).norm() / ref.norm() < ERROR_BOUND[name] + 0.02
