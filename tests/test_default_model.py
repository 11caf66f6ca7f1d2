"""The built-in default model (SmolLM2-135M-Instruct, from its GGUF) end to end, one shared engine."""
import pytest
import torch

from tokenmill import SamplingParams

pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def default_llm():
    from tokenmill.models.default_model import default_model_path

    try:
        default_model_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    from tokenmill import LLM

    return LLM(None, dtype="float32", kv_cache_memory_bytes="256MiB")


def test_paris_and_equal_to_transformers(default_llm):
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is"
    out = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32),
                               use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris")
    # The converted directory equals transformers' own GGUF load tensor for tensor (tests/test_gguf.py).
    ref_model = AutoModelForCausalLM.from_pretrained(default_llm.config.model.model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    with torch.inference_mode():
        ref = ref_model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=2)
    assert len(out.outputs[0].token_ids) >= 16
    assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_chat(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
    assert default_llm.engine.scheduler.kv.is_whole()
