"""Tiny random-weight Hugging Face models of every supported architecture, built once per session.

Each directory holds config.json, model.safetensors and a small byte-level BPE tokenizer (with a chat
template), so the engine loads them exactly as it loads a real checkpoint.
"""
from __future__ import annotations

import os
import tempfile
from typing import Optional

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks of tokens.",
    "Continuous batching admits new requests as soon as others finish.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Hello, world! The capital of France is Paris. 0123456789",
    "Speculative decoding proposes several tokens and verifies them in one pass.",
]

ARCHS = {
    # arch -> (config class name, extra config fields)
    "llama": ("LlamaConfig", dict(tie_word_embeddings=True, num_key_value_heads=2,
                                  rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256})),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, num_key_value_heads=1, sliding_window=48)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True, num_key_value_heads=2, head_dim=32)),
}

# Mixture-of-experts archs, apart from ARCHS so the dense archs keep their seeds (and test_model_exactness its
# list). 4 experts, top-2; head counts divisible by 2 for TP=2. qwen3_moe's layer 1 is dense
# (mlp_only_layers); qwen3_moe_norm's layers 0 and 2 are (decoder_sparse_step=2).
MOE_ARCHS = {
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_key_value_heads=2, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=True, num_key_value_heads=2, head_dim=32,
                                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_key_value_heads=2, head_dim=32,
                                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                              norm_topk_prob=True, num_hidden_layers=4, decoder_sparse_step=2)),
}
# Gemma 3 (text), apart from ARCHS too: every field that sets it apart from the Llama family is set, to a value
# where getting it wrong shows: local and global layers mixed (the global one in the middle), a sliding window
# shorter than the test prompts, distinct rope bases with linear scaling on the global layer only, a
# query_pre_attn_scalar other than head_dim, head_dim other than hidden / heads, a non-default rms_norm_eps.
# Its norm weights are randomized after init (transformers zeroes them: 1 + w would be 1 everywhere).
GEMMA_ARCHS = {
    "gemma3": ("Gemma3TextConfig", dict(
        tie_word_embeddings=True, num_hidden_layers=3, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24,
        rms_norm_eps=1e-5, sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
        architectures=["Gemma3ForCausalLM"])),
}
# gpt-oss, apart too: sliding and full layers alternating (window shorter than the test prompts), YaRN rope,
# q/k/v/o biases, 4 experts top-2 with router and expert biases, a swiglu_limit the activations reach; sinks,
# biases and the router's bias are randomized after init (transformers zeroes the expert biases). Widths are
# multiples of 32 per TP rank, so the same experts quantize to MXFP4 (test_gpt_oss.py).
GPT_OSS_ARCHS = {
    "gpt_oss": ("GptOssConfig", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, sliding_window=24,
        num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.0, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150000.0})),
}
# DeepSeek V3 and V2 (multi-head latent attention, grouped-top-k MoE with shared experts), apart too: every
# distinguishing field set where a mistake shows. V3: q_lora_rank, YaRN with mscale != mscale_all_dim (both the
# rope tables and the softmax scale change), interleaved rope, sigmoid routing over 4 groups keeping 2 with a
# (randomized) correction bias, norm_topk_prob, routed_scaling_factor, first_k_dense_replace=1,
# v_head_dim != qk_nope_head_dim. V2: q_lora_rank None (V2-Lite's q_proj), softmax group_limited_greedy routing,
# two shared experts, top-3. Norm weights (the latent norms included) are randomized after init.
DEEPSEEK_ARCHS = {
    "deepseek_v3": ("DeepseekV3Config", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, moe_intermediate_size=32, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                         "mscale": 1.0, "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1,
                         "rope_theta": 10000.0},
        architectures=["DeepseekV3ForCausalLM"])),
    "deepseek_v2": ("DeepseekV2Config", dict(
        tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=3, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5, first_k_dense_replace=1, moe_intermediate_size=24,
        architectures=["DeepseekV2ForCausalLM"])),
}
_SEEDS = {arch: 1234 + i for i, arch in enumerate(sorted(ARCHS))}
_SEEDS.update({arch: 2234 + i for i, arch in enumerate(sorted(MOE_ARCHS))})
_SEEDS.update({arch: 3234 + i for i, arch in enumerate(sorted(GEMMA_ARCHS))})
_SEEDS.update({arch: 5234 + i for i, arch in enumerate(sorted(GPT_OSS_ARCHS))})
_SEEDS.update({arch: 4234 + i for i, arch in enumerate(sorted(DEEPSEEK_ARCHS))})

_cache: dict[str, str] = {}
_root = None


def build_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
    return fast


def _root_dir() -> str:
    global _root
    if _root is None:
        _root = tempfile.mkdtemp(prefix="tokenmill-tiny-")
    return _root


def tiny_model(arch: str) -> str:
    """Path of a tiny random `arch` model directory (built on first use, then reused)."""
    if arch in _cache:
        return _cache[arch]
    import transformers

    path = os.path.join(_root_dir(), arch)
    tok = build_tokenizer(path)
    cls_name, extra = {**ARCHS, **MOE_ARCHS, **GEMMA_ARCHS, **GPT_OSS_ARCHS, **DEEPSEEK_ARCHS}[arch]
    fields = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.08,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    config = getattr(transformers, cls_name)(**{**fields, **extra})
    torch.manual_seed(_SEEDS[arch])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # biases are zero-initialised; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if arch in GEMMA_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    if arch in GPT_OSS_ARCHS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(("sinks", "bias")):
                    param.normal_(0, 1.0 if name.endswith("sinks") else 0.3)
    if arch in DEEPSEEK_ARCHS:  # norms start at 1 and the correction bias at 0: make them matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(1, 0.3)
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.normal_(0, 0.1)
    model.save_pretrained(path)
    _cache[arch] = path
    return path


def hf_model(path: str, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def tiny_bert() -> str:
    """A tiny random BertModel laid out as a sentence-transformers folder (modules.json, mean pooling in
    1_Pooling/config.json, Normalize), with the byte-level BPE tokenizer of the other tiny models."""
    if "bert" in _cache:
        return _cache["bert"]
    import json

    import transformers

    path = os.path.join(_root_dir(), "bert")
    tok = build_tokenizer(path)
    config = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=512, initializer_range=0.08,
                                     pad_token_id=tok.pad_token_id)
    torch.manual_seed(4321)
    transformers.BertModel(config).save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    _cache["bert"] = path
    return path


# Qwen2.5-VL: a tiny random model with a 2-block vision tower. Each field is set where getting it wrong shows:
# window attention in block 0 (a window of 2x2 merged patches, smaller than the test images) and full attention
# in block 1, an M-RoPE split of the text head's 8 frequencies other than an even one, q/k/v biases randomized.
VLM_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' or c['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vlm() -> str:
    """Path of a tiny random Qwen2_5_VLForConditionalGeneration directory (with preprocessor_config.json)."""
    if "qwen2_5_vl" not in _cache:
        _cache["qwen2_5_vl"] = build_vlm(os.path.join(_root_dir(), "qwen2_5_vl"))
    return _cache["qwen2_5_vl"]


def build_vlm(path: str, text_sizes: Optional[dict] = None, vision_sizes: Optional[dict] = None,
              max_pixels: int = 28 * 28 * 64) -> str:
    """A random Qwen2.5-VL in `path`: tiny_vlm's, or with the text / vision config sizes given (benchmarks)."""
    import json

    import transformers

    tok = build_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": VLM_SPECIAL})
    tok.chat_template = VLM_CHAT_TEMPLATE
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VLM_SPECIAL}
    text = {**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id),
            **(text_sizes or {})}
    vision = {**dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, fullatt_block_indexes=[1],
                     window_size=56, patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
              **(vision_sizes or {})}
    vision["out_hidden_size"] = text["hidden_size"]
    config = transformers.Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, initializer_range=0.08,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(5234)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.normal_(0, 0.3 if "bias" in name else 0.1).add_(0 if "bias" in name else 1)
            else:
                param.normal_(0, 0.08)
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": max_pixels,
                   "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073],
                   "image_std": [0.26862954, 0.26130258, 0.27577711]}, f)
    return path
