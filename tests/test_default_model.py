"""The built-in default model (SmolLM2-135M-Instruct, from its GGUF) end to end, one shared engine."""
import pytest
import torch

from tokenmill import SamplingParams

pytest.importorskip("gguf")


def _llm(**kwargs):
    from tokenmill.models.default_model import default_model_path

    try:
        default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    from tokenmill import LLM

    return LLM(None, dtype="float32", kv_cache_memory_bytes="256MiB", **kwargs)


@pytest.fixture(scope="session")
def default_llm():
    """As served by default: the GGUF's own Q4_1/Q8_0 blocks (--gguf-weights native)."""
    return _llm()


@pytest.fixture(scope="session")
def dequantized_llm():
    return _llm(gguf_weights="dequantize")


PROMPT = "The capital of France is"


def test_dequantized_equals_transformers(dequantized_llm):
    from transformers import AutoModelForCausalLM

    out = dequantized_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris")
    # The converted directory equals transformers' own GGUF load tensor for tensor (tests/test_gguf.py).
    ref_model = AutoModelForCausalLM.from_pretrained(dequantized_llm.config.model.model_dir,
                                                     dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        ref = ref_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
    assert len(out.outputs[0].token_ids) >= 16
    assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_native_by_default_and_close_to_dequantized(default_llm):
    """The default model runs from its blocks (integer kernels, 8-bit activations per 32 values): the same
    answer, and teacher-forced through the decode kernel its next-token choices are the exact float path's at
    most positions, with perplexity within 1% (eval quality's gguf-decode variant)."""
    from tokenmill.eval.quality import evaluate

    kernels = default_llm.engine.executor.kernels()
    assert kernels["linear"].startswith("ggml-") and set(kernels["block_types"]) == {"Q4_1", "Q8_0"}
    out = default_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris")
    ref, native = evaluate(None, ["gguf-decode"], max_tokens=512, window=256, dtype="float32")
    assert native.agree >= 0.9 * native.tokens, (native.agree, native.tokens)
    assert abs(native.perplexity / ref.perplexity - 1) < 0.01, (native.perplexity, ref.perplexity)


def test_chat(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    assert default_llm.engine.scheduler.kv.is_whole()
