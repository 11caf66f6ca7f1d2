"""GGUF weights served in their own block types (--gguf-weights native) against the dequantized float path.

The models are tiny random ones written as GGUF with every supported ggml type (tests/gguf_models.py): each
layer's blocks must stand for exactly the weights the float conversion produces (the wiring: merged q|k|v and
gate|up parts, llama's Q/K row order, the tied head, the embedding lookup), and a whole model's greedy tokens
must follow the float path's. The kernels' own accuracy bound is tests/test_ggml_kernels.py's.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gguf_models import ALL_TYPES, quantized_gguf
from tokenmill.models.gguf import gguf_to_hf_dir

pytest.importorskip("gguf")
K_TYPES = ("Q4_K", "Q6_K", "Q5_0", "Q8_0")  # a Q4_K_M-like mix
TOKENIZER_TEXT = "Hello world!  naïve café, 12345 + x**2\n\tdef f(): return 1"  # digits split apart by Qwen2's rule


@pytest.fixture(scope="module")
def files():
    return {"llama": quantized_gguf("llama", ALL_TYPES), "qwen2": quantized_gguf("qwen2", ALL_TYPES[5:] + ALL_TYPES[:5]),
            "qwen2_kmix": quantized_gguf("qwen2", K_TYPES)}


def _load(model_dir: str):
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu",
                      get_attention_backend("cpu"), max_positions=256)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_blocks_stand_for_the_dequantized_weights(files, arch):
    """Every linear layer's parts dequantize to the float conversion's weight, bit for bit, and the embedding
    looks up the same rows; only norms, biases and layers stored as float in the file hold float parameters."""
    from tokenmill.layers.linear import LinearBase
    from tokenmill.layers.quantization.gguf_blocks import BlockEmbedding, BlockLinearMethod

    native, ref = _load(gguf_to_hf_dir(files[arch], "native")), _load(gguf_to_hf_dir(files[arch], "dequantize"))
    ref_layers = dict(ref.named_modules())
    checked, float_layers = 0, set()
    for name, layer in native.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        reference = ref_layers[name].weight.data
        if isinstance(layer.quant_method, BlockLinearMethod):
            assert torch.equal(layer.quant_method.dequantized_weight(layer), reference), name
            checked += 1
        else:  # all of its tensors are float in the file
            assert torch.equal(layer.weight.data, reference), name
            float_layers.add(f"{name}.weight")
    assert checked >= 5
    assert isinstance(native.embed_tokens, BlockEmbedding)
    ids = torch.tensor([0, 5, 17, 399, 5])
    assert torch.equal(native.embed_tokens(ids), ref.embed_tokens(ids))
    floats = [n for n, p in native.named_parameters() if p.dtype.is_floating_point]
    assert all("norm" in n or n.endswith("bias") or n in float_layers for n in floats), floats


def _generate(path: str, mode: str, prompts: list[str], max_tokens: int = 24):
    from tokenmill import LLM
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(model=path, dtype="float32", gguf_weights=mode, kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.executor.kernels()


PROMPTS = ["The quick brown fox", "Hello, world! The capital of", "def main():\n    print(", "Paged attention"]


@pytest.mark.parametrize("name", ["llama", "qwen2_kmix"])
def test_greedy_tokens_follow_the_dequantized_path(files, name):
    """The native kernels round the activations to 8 bits per 32-block, so exact equality is not guaranteed;
    the tokens must agree up to the first divergence on most positions."""
    native, kernels = _generate(files[name], "native", PROMPTS)
    ref, _ = _generate(files[name], "dequantize", PROMPTS)
    agree = total = 0
    for a, b in zip(native, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        agree, total = agree + n, total + len(b)
    assert agree >= 0.75 * total, (native, ref)
    assert kernels["decoder_stack"] == "on", kernels
    assert "ggml" in kernels["linear"], kernels


def test_native_writes_no_float_copy(files):
    native = gguf_to_hf_dir(files["qwen2_kmix"], "native")
    names = os.listdir(native)
    assert "config.json" in names and not any(n.endswith(".safetensors") for n in names), names
    size = sum(os.path.getsize(os.path.join(native, n)) for n in names)
    assert size < 0.1 * os.path.getsize(files["qwen2_kmix"]) + 200_000, size


def test_online_quantization_starts_from_float_weights(files):
    """--quantization on a GGUF quantizes its dequantized float weights (auto picks dequantize); asked for
    together with --gguf-weights native it is refused."""
    from tokenmill import LLM

    llm = LLM(model=files["llama"], dtype="float32", quantization="int8", kv_cache_memory_bytes=64 << 20)
    assert llm.engine.executor.kernels()["linear"].startswith("qlinear-c-int8")
    with pytest.raises(ValueError, match="--gguf-weights dequantize"):
        LLM(model=files["llama"], dtype="float32", gguf_weights="native", quantization="int8",
            kv_cache_memory_bytes=64 << 20)


def test_bad_gguf_weights_value_is_refused():
    from tokenmill.models.gguf import weights_mode

    with pytest.raises(ValueError, match="--gguf-weights must be one of"):
        weights_mode("x.gguf", "float")


def test_moe_experts_stay_in_blocks(tiny, tmp_path, monkeypatch):
    """A Q8_0 Mixtral GGUF: the experts run from their blocks and the tokens follow the dequantized path."""
    import tokenmill.models.gguf as gguf_mod
    from moe_models import tiny_moe_gguf
    from tokenmill.layers.fused_moe import FusedMoE
    from tokenmill.layers.quantization.gguf_blocks import BlockMoEMethod

    monkeypatch.setattr(gguf_mod, "cache_root", lambda: str(tmp_path))
    path = tiny_moe_gguf(tiny("mixtral"), "mixtral", "Q8_0")
    model = _load(gguf_to_hf_dir(path, "native"))
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert moes and all(isinstance(m.quant_method, BlockMoEMethod) for m in moes)
    assert all(p.numel() == 0 for m in moes for n, p in m.named_parameters() if n != "gate.weight")
    native, _ = _generate(path, "native", PROMPTS, 16)
    ref, _ = _generate(path, "dequantize", PROMPTS, 16)
    agree = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(native, ref))
    assert agree >= 0.75 * sum(len(b) for b in ref), (native, ref)


def test_float32_activations_are_quantized_twice():
    """gg_linear_precise (float32 x): the residual of the int8 activations is quantized and run too, so the
    error is about 1/254 of the int8 kernel's (bf16 x); checked against the exact float product."""
    import gguf as gguf_py
    import numpy as np

    from tokenmill.layers.quantization import ggml

    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    blocks = gguf_py.quants.quantize(w, gguf_py.GGMLQuantizationType.Q8_0)
    part = ggml.Part(int(gguf_py.GGMLQuantizationType.Q8_0), torch.from_numpy(np.ascontiguousarray(blocks)))
    exact_w = ggml.dequantize(part, 512).double()
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
    exact = x.double() @ exact_w.T
    bl = ggml.bind([part], 512)
    err_precise = (bl(x, None).double() - exact).abs().max().item()
    err_int8 = (bl(x.bfloat16(), None).double() - x.bfloat16().double() @ exact_w.T).abs().max().item()
    assert err_precise < err_int8 / 20, (err_precise, err_int8)


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2Tokenizer"), ("qwen3", "Qwen2Tokenizer"),
                                      ("llama", "TokenizersBackend")])
def test_gguf_tokenizer_is_autotokenizers_choice(arch, cls):
    """The conversion names the tokenizer class for the model type (skipping AutoTokenizer's config step, which
    parses the whole file): the class and the ids AutoTokenizer's full path gives."""
    from transformers import AutoTokenizer

    from tokenmill.models.gguf import _gguf_tokenizer

    path = quantized_gguf(arch, ("Q8_0",))
    full = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    fast = _gguf_tokenizer(path, arch, arch)
    assert type(fast) is type(full) and type(full).__name__ == cls
    assert fast(TOKENIZER_TEXT).input_ids == full(TOKENIZER_TEXT).input_ids
    assert (fast.bos_token, fast.eos_token, fast.pad_token) == (full.bos_token, full.eos_token, full.pad_token)
    assert fast.chat_template == full.chat_template


def test_served_tokenizer_follows_the_files_pre_tokenizer(monkeypatch, tmp_path):
    """A converted GGUF is served with its tokenizer.json as the file's tokenizer.ggml.pre made it (the test
    files say "default": digits in runs), cold and warm, where AutoTokenizer's Qwen2Tokenizer rebuilds Qwen2's
    split from the vocabulary (digits one by one)."""
    from transformers import AutoTokenizer

    from tokenmill.config import EngineConfig
    from tokenmill.engine.frontend import load_tokenizer
    from tokenmill.models.resolution import resolve_engine_config

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    path = quantized_gguf("qwen2", ("Q8_0",))
    in_file = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    served = []
    for start in ("cold", "warm"):
        config = resolve_engine_config(EngineConfig.from_kwargs(model=path, dtype="float32"))
        assert config.model.tokenizer_class is not None  # cold: the GGUF folder's; warm: the record's
        assert (config.model.resolution_key is None) == (start == "warm")
        served.append(load_tokenizer(config))
    for tok in served:
        assert tok(TOKENIZER_TEXT).input_ids == in_file(TOKENIZER_TEXT).input_ids
        assert (tok.bos_token, tok.eos_token, tok.chat_template) == (in_file.bos_token, in_file.eos_token,
                                                                     in_file.chat_template)
    by_class = AutoTokenizer.from_pretrained(served[0].name_or_path)  # Qwen2Tokenizer: Qwen2's own split
    assert by_class(TOKENIZER_TEXT).input_ids != in_file(TOKENIZER_TEXT).input_ids


# (rope_theta, head_dim, Llama 3 rope scaling): Llama 3.1 8B's and Llama 3.2 1B's, the tiny test models', and
# two whose wavelengths leave none / one divisor between 1 and the factor (too few to fit a line through)
LLAMA3_ROPES = [(500000.0, 128, 8.0, 1.0, 4.0, 8192), (500000.0, 64, 32.0, 1.0, 4.0, 8192),
                (10000.0, 64, 4.0, 1.0, 4.0, 256), (10000.0, 16, 4.0, 1.0, 2.0, 500), (10000.0, 16, 4.0, 1.0, 1.5, 256)]


@pytest.mark.parametrize("theta,head_dim,factor,low,high,original", LLAMA3_ROPES)
def test_llama3_rope_scaling_is_read_from_rope_freqs(theta, head_dim, factor, low, high, original):
    """llama.cpp's converter keeps Llama 3's rope scaling only as rope_freqs.weight (each frequency's divisor):
    the rope_scaling read back from it must give transformers' llama3 rope exactly where the original did."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gguf_models import llama3_rope_freqs
    from tokenmill.models.gguf import _llama3_rope

    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": original}
    divisors = llama3_rope_freqs(rope, theta, head_dim).astype(np.float64)
    got = _llama3_rope("f.gguf", {"head_dim": head_dim, "rope_theta": theta}, divisors)

    def inv_freq(params):
        config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                             max_position_embeddings=131072, rope_parameters={**params, "rope_theta": theta})
        return ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))[0]

    torch.testing.assert_close(inv_freq(got), inv_freq(rope), rtol=1e-6, atol=0)
    unscaled = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    torch.testing.assert_close(unscaled / inv_freq(got), torch.tensor(divisors, dtype=torch.float))
    assert got["rope_type"] == "llama3" and got["factor"] == factor
    if (theta, head_dim) == (500000.0, 128):  # a real file's: its very numbers back
        assert got == rope, got


def test_rope_freqs_of_another_shape_are_refused():
    from tokenmill.models.gguf import _llama3_rope

    config = {"head_dim": 64, "rope_theta": 10000.0}
    for divisors in (np.ones(16), np.linspace(1, 4, 32)[::-1].copy(), np.full(32, 0.5)):
        with pytest.raises(ValueError, match="rope_freqs.weight is not a Llama 3 rope scaling"):
            _llama3_rope("f.gguf", config, divisors)


def test_llama3_gguf_keeps_the_models_rope(tmp_path):
    """A Llama 3-style model written as llama.cpp writes it (rope_freqs.weight, float weights) and converted back
    gives transformers the original model's logits: the rope scaling survived the file."""
    from transformers import AutoModelForCausalLM

    from gguf_models import tiny_model

    reference, _ = tiny_model("llama", str(tmp_path / "tok"))
    converted = AutoModelForCausalLM.from_pretrained(
        gguf_to_hf_dir(quantized_gguf("llama", ("F32",)), "dequantize"), dtype=torch.float32)
    assert converted.config.rope_parameters["rope_type"] == "llama3"
    ids = torch.randint(0, reference.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-4)
