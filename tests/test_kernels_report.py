"""The engine's kernels report (worker/kernels_report.py): it names the paths a real engine runs, logs every
fallback with its reason once at startup, and TOKENMILL_REQUIRE_KERNELS=1 turns any fallback into a start-up
error (while paths the model itself chooses stay allowed)."""
import logging
import os
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_build, cpu_linear
from tokenmill.worker import kernels_report
from tokenmill.layers.attention import triton_paged
from tokenmill.layers.attention.cpu import PagedAttentionBackend

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")


def _engine(tiny, arch="llama", **kw):
    return LLM(tiny(arch), num_gpu_blocks_override=64, block_size=16, **kw)


def _kernels(llm) -> dict:
    return llm.engine.executor.kernels()


def _fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and r.getMessage().startswith("slow path:")]


@pytest.mark.parametrize("arch,dtype,linear", [("llama", "float32", "panel-gemm-f32"),
                                               ("qwen3", "bfloat16", "panel-gemm-bf16")])
def test_report_names_the_paths_in_use(tiny, arch, dtype, linear, caplog, monkeypatch):
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")  # nothing to fall back from: starts fine
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = _engine(tiny, arch, dtype=dtype)
    k = _kernels(llm)
    assert {key: k[key] for key in ("attention", "linear", "norm_act_rope", "decoder_stack", "fallbacks")} == {
        "attention": "cpu-paged-c", "linear": linear, "norm_act_rope": "cpu-fused-c", "decoder_stack": "on",
        "fallbacks": []}
    for name in ("paged_attention", "skinny_linear", "cpu_fused", "decoder_stack"):
        assert k["libraries"][name] == "loaded"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:")]
    assert lines == [f"kernels: attention=cpu-paged-c, linear={linear}, norm/act/rope=cpu-fused-c, decoder stack=on"]
    assert not _fallback_warnings(caplog)


def test_model_features_are_reported_but_not_fallbacks(tiny, monkeypatch):
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")
    k = _kernels(_engine(tiny, kv_cache_dtype="int8", quantization="int8"))
    # the LM head stays float (no --quantize-lm-head) and keeps the packed panel kernel
    assert k["linear"] == "qlinear-c-int8 x8, panel-gemm-f32 x1" and k["libraries"]["qlinear"] == "loaded"
    assert k["decoder_stack"] == "off: 8-bit KV cache" and k["fallbacks"] == []


def test_packing_budget_fallback_is_logged_and_required(tiny, caplog, monkeypatch):
    monkeypatch.setenv("TOKENMILL_PACK_BUDGET_FRACTION", "0")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = _engine(tiny)
    k = _kernels(llm)
    assert k["linear"] == kernels_report.UNPACKED
    assert k["decoder_stack"] == "off: linear weights left unpacked (packed-weight budget exhausted)"
    assert len(k["fallbacks"]) == 2 and k["fallbacks"][0].startswith("packed-weight budget (0% of RAM")
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 2 and "9 of 9 linear layers run unpacked" in warnings[0]
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # slower, still correct
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")
    with pytest.raises(RuntimeError, match=r"TOKENMILL_REQUIRE_KERNELS=1 but the engine would run slow paths: "
                                           r"packed-weight budget .*decoder stack off"):
        _engine(tiny)


def test_disabled_kernels_fallback_is_logged_and_required(tiny, caplog, monkeypatch):
    monkeypatch.setattr(cpu_build, "_loaded", {})  # this process's libraries, as if nothing had loaded yet
    monkeypatch.setattr(cpu_build, "_status", {})
    monkeypatch.setenv("TOKENMILL_CPU_KERNELS", "0")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        k = _kernels(_engine(tiny))
    assert (k["attention"], k["linear"], k["norm_act_rope"]) == ("sdpa-gathered", "torch", "torch")
    assert k["decoder_stack"].startswith("off: C kernel libraries unavailable")
    # every library is loaded up front at start-up (the ledger's "kernels" phase), qlinear and ggml included
    assert k["fallbacks"][0] == ("C kernel libraries cpu_fused, decoder_stack, ggml, paged_attention, qlinear, "
                                 "skinny_linear unavailable: disabled by TOKENMILL_CPU_KERNELS=0")
    assert len(_fallback_warnings(caplog)) == len(k["fallbacks"]) == 2
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "1")
    with pytest.raises(RuntimeError, match="slow paths: C kernel libraries .* disabled by TOKENMILL_CPU_KERNELS=0"):
        _engine(tiny)


def test_cuda_without_triton_is_a_fallback(monkeypatch):
    monkeypatch.setattr(triton_paged, "available", lambda: False)
    fallbacks = []
    backend = PagedAttentionBackend("cuda")  # builds no CUDA tensors: runs on any machine
    assert kernels_report._attention(backend, "cuda", torch.bfloat16, fallbacks) == "sdpa-gathered"
    assert fallbacks == ["CUDA without Triton: decode attention runs gathered SDPA (install triton)"]


@pytest.mark.parametrize("name,value,read,message", [
    ("TOKENMILL_REQUIRE_KERNELS", "yes", kernels_report.require_kernels,
     "TOKENMILL_REQUIRE_KERNELS must be 0 or 1, not 'yes'"),
    ("TOKENMILL_PACK_BUDGET_FRACTION", "2", cpu_linear.pack_budget_fraction,
     r"TOKENMILL_PACK_BUDGET_FRACTION must be a fraction of RAM in \[0, 1\], not '2'")])
def test_bad_settings_are_one_line_errors(monkeypatch, name, value, read, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        read()


def test_kernels_required_scopes_the_setting(monkeypatch):
    monkeypatch.delenv("TOKENMILL_REQUIRE_KERNELS", raising=False)
    with kernels_report.kernels_required():
        assert kernels_report.require_kernels()
    assert "TOKENMILL_REQUIRE_KERNELS" not in os.environ
    monkeypatch.setenv("TOKENMILL_REQUIRE_KERNELS", "0")  # an explicit choice wins
    with kernels_report.kernels_required():
        assert not kernels_report.require_kernels()
