"""Tiny random models written as quantized GGUF files, every tensor in a chosen ggml type.

The legacy types (Q4_0 ... Q8_0) are quantized from the tiny model's float weights with gguf-py; gguf-py cannot
quantize K-quants or IQ4, so those tensors are random blocks whose fp16 scales are set to small finite values (any
such bytes are a valid block; the scales are picked so the weights have roughly the float model's size).
The GGUF's tokenizer is the tiny models' BPE, written as llama.cpp's converter writes a gpt2 tokenizer.
`gemma3_gguf` writes a tiny Gemma 3 directory with llama.cpp's Gemma 3 conventions.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from models import ARCHS, build_tokenizer
from moe_models import add_gpt2_tokenizer

ALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "F16", "BF16", "F32")
# K-quant block: (byte offsets of the fp16 d / dmin fields, d giving weights of ~0.05)
_K_SCALES = {"Q2_K": ((80, 82), 1e-3), "Q3_K": ((108,), 4e-4), "Q4_K": ((0, 2), 5e-5), "Q5_K": ((0, 2), 2.5e-5),
             "Q6_K": ((208,), 1.2e-5), "IQ4_NL": ((0,), 4e-4), "IQ4_XS": ((0,), 1.5e-5)}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _encode(w: np.ndarray, type_name: str, rng: np.random.Generator):
    """(data, ggml type) of float32 w [N, K] in type_name, as GGUFWriter.add_tensor takes it."""
    import gguf
    from gguf import GGMLQuantizationType as T

    t = T[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "F16":
        return w.astype(np.float16), None
    if type_name == "BF16":
        bits = (w.astype(np.float32).view(np.uint32) + 0x8000) >> 16  # round to nearest (no NaNs here)
        return bits.astype(np.uint16).view(np.uint8).reshape(w.shape[0], -1), t
    if type_name not in _K_SCALES:
        return gguf.quants.quantize(w.astype(np.float32), t), t
    values, nbytes = gguf.GGML_QUANT_SIZES[t]
    blocks = rng.integers(0, 256, size=(w.size // values, nbytes), dtype=np.uint8)
    offsets, d = _K_SCALES[type_name]
    for i, off in enumerate(offsets):
        scale = (d * rng.uniform(0.5, 1.5, size=blocks.shape[0]) * (0.5 if i else 1.0)).astype(np.float16)
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(w.shape[0], -1), t


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter: HF's rotary halves -> interleaved pairs per head
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_model(arch: str, path: str, hidden: int = 256, intermediate: int = 512):
    """A tiny random transformers model (2 layers, 4 heads of hidden / 4) and its tokenizer."""
    import torch
    import transformers

    tok = build_tokenizer(path)
    cls_name, extra = ARCHS[arch]
    extra = {k: v for k, v in extra.items() if k not in ("head_dim", "sliding_window")}
    config = getattr(transformers, cls_name)(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.05,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id, **extra)
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model, tok


def llama3_rope_freqs(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter writes it for Llama 3's rope scaling (conversion/llama.py):
    each rotary frequency's divisor."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * np.pi / float(freq)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_metadata(w, config, tok) -> None:
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(config.hidden_size // config.num_attention_heads)
    w.add_value_length(config.hidden_size // config.num_attention_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"])
    add_gpt2_tokenizer(w, tok)
    w.add_chat_template(tok.chat_template)


def quantized_gguf(arch: str, types, hidden: int = 256, intermediate: int = 512, seed: int = 0) -> str:
    """Path of a GGUF of a tiny random `arch` model whose 2-D weights take `types` in turn (norms stay F32)."""
    import gguf

    root = tempfile.mkdtemp(prefix="tokenmill-gguf-")
    model, tok = tiny_model(arch, os.path.join(root, "hf"), hidden, intermediate)
    config, rng = model.config, np.random.default_rng(seed)
    path = os.path.join(root, f"{arch}-{'-'.join(types)}.gguf")
    w = gguf.GGUFWriter(path, _GGUF_ARCH[arch])
    _add_metadata(w, config, tok)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":  # the Llama 3 rope scaling, as the only place llama.cpp puts it
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, rope["rope_theta"], config.head_dim))
    turn = 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = t.float().numpy()
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            gname = {"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[name.split(".")[0]]
        else:
            parts = name.split(".")  # layers.i.<module>.weight|bias
            module = ".".join(parts[2:-1])
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = config.num_attention_heads if module.endswith("q_proj") else config.num_key_value_heads
                data = _permute(data, heads)
            gname = f"blk.{parts[1]}.{_LAYER[module]}"
        gname += "." + name.rpartition(".")[2]
        _add_tensor(w, gname, data, types[turn % len(types)], rng)
        turn += data.ndim == 2
    return _close(w, path)


def _add_tensor(w, gname: str, data, type_name: str, rng) -> None:
    """A matrix in the given block type (random blocks where the type asks for them), anything else float32."""
    if data.ndim == 2:
        data, raw = _encode(data, type_name, rng)
        w.add_tensor(gname, np.ascontiguousarray(data), raw_dtype=raw)
    else:
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))


def _close(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- Gemma 3, as llama.cpp's convert_hf_to_gguf.py writes it (conversion/gemma.py, Gemma3Model) ----------------
_GEMMA3_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def add_base_metadata(w, config: dict, head_count_kv: int) -> None:
    """The keys every converter writes the same way from a config.json dict (the architecture adds its own)."""
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(head_count_kv)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])


def _gemma3_metadata(w, config: dict) -> None:
    """The converter's Gemma 3 keys: rope.freq_base is the global layers' (with their rope scaling),
    rope.freq_base_swa the local ones'; attention.sliding_window. It writes no per-layer pattern (llama.cpp
    then takes five local layers to one global); the tiny model's layer types differ, so its per-layer flags
    go in attention.sliding_window_pattern, a key llama.cpp reads."""
    import gguf

    layers, rope = config["num_hidden_layers"], config["rope_parameters"]
    add_base_metadata(w, config, config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if rope["full_attention"].get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if config.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(config["final_logit_softcapping"])
    w.add_sliding_window(config["sliding_window"])
    flags = [t == "sliding_attention" for t in config["layer_types"]]
    if flags != [i % 6 < 5 for i in range(layers)]:
        w.add_sliding_window_pattern(flags)


def gemma3_gguf(hf_dir: str, type_name: str = "F32", seed: int = 0) -> str:
    """A GGUF of the tiny Gemma 3 model in hf_dir: its 2-D weights in type_name, norms F32 as 1 + w (the
    converter adds Gemma's 1), no output.weight (tied), llama.cpp's tensor names, the tiny BPE as gpt2."""
    import json

    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    path = os.path.join(tempfile.mkdtemp(prefix="tokenmill-gguf-"), f"gemma3-{type_name}.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    _gemma3_metadata(w, config)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    add_gpt2_tokenizer(w, tok)
    w.add_chat_template(tok.chat_template)
    rng = np.random.default_rng(seed)
    for name, data in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        if name in ("embed_tokens.weight", "norm.weight"):
            gname = {"embed_tokens": "token_embd", "norm": "output_norm"}[name.split(".")[0]]
        else:
            parts = name.split(".")  # layers.i.<module>.weight
            gname = f"blk.{parts[1]}.{_GEMMA3_LAYER['.'.join(parts[2:-1])]}"
        gname += ".weight"
        _add_tensor(w, gname, data.astype(np.float32) if data.ndim == 2 else data, type_name, rng)
    return _close(w, path)


# -- DeepSeek-V2/V3, as llama.cpp's convert_hf_to_gguf.py writes it (DeepseekV2Model: arch deepseek2) -----------
_DEEPSEEK_LAYER = {**_LAYER, "self_attn.q_a_proj": "attn_q_a", "self_attn.q_b_proj": "attn_q_b",
                   "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
                   "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
                   "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                   "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def _deepseek_metadata(w, config: dict) -> None:
    """The converter's keys: MLA written as MQA (key_length kv_lora_rank + rope, value_length kv_lora_rank, one
    KV head) with the per-head sizes in the *_mla keys; the router's gating function (V3: sigmoid); YaRN's
    mscale_all_dim as yarn_log_multiplier = 0.1 x it; the expert groups."""
    import gguf

    add_base_metadata(w, config, 1)  # MLA written as MQA: one KV head
    rope = config.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    if config.get("q_lora_rank"):
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(config["kv_lora_rank"])
    w.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
    w.add_value_length(config["kv_lora_rank"])
    w.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
    w.add_value_length_mla(config["v_head_dim"])
    w.add_rope_dimension_count(config["qk_rope_head_dim"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(config.get("norm_topk_prob")))
    v3 = config["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_expert_group_count(config["n_group"])
    w.add_expert_group_used_count(config["topk_group"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek_tensors(name: str, data: np.ndarray, config: dict):
    """(GGUF name, data) of one HF tensor (experts already stacked per projection: mlp.experts.<proj> [E, ...]):
    kv_b split per head into attn_k_b (transposed) and attn_v_b, the router bias as exp_probs_b."""
    parts = name.split(".")  # layers.i.<module>.<param>
    if parts[0] != "layers":
        return [({"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[parts[0]] + ".weight",
                 data)]
    blk, module = f"blk.{parts[1]}", ".".join(parts[2:-1])
    if module == "mlp.experts":
        return [(f"{blk}.ffn_{parts[-1].removesuffix('_proj')}_exps.weight", data)]
    if parts[-1] == "e_score_correction_bias":
        return [(f"{blk}.exp_probs_b.bias", data)]
    if module == "self_attn.kv_b_proj":
        heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
        kv_b = data.reshape(heads, nope + config["v_head_dim"], -1)
        return [(f"{blk}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1)), (f"{blk}.attn_v_b.weight", kv_b[:, nope:])]
    return [(f"{blk}.{_DEEPSEEK_LAYER[module]}.{parts[-1]}", data)]


def deepseek_gguf(hf_dir: str, type_name: str = "F32", seed: int = 0) -> str:
    """A GGUF of the tiny DeepSeek model in hf_dir: its 2-D weights in type_name (the router, and rows not of
    whole blocks, float32), 3-D ones (expert stacks, attn_k_b/attn_v_b) and norms float32, llama.cpp's names, the
    tiny BPE."""
    import json

    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    path = os.path.join(tempfile.mkdtemp(prefix="tokenmill-gguf-"), f"{config['model_type']}-{type_name}.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    _deepseek_metadata(w, config)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    add_gpt2_tokenizer(w, tok)
    rng = np.random.default_rng(seed)
    tensors, experts = {}, {}
    for name, data in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        parts = name.removeprefix("model.").split(".")
        if len(parts) == 7 and parts[3] == "experts":  # layers.i.mlp.experts.e.<proj>.weight: stacked below
            experts.setdefault(f"layers.{parts[1]}.mlp.experts.{parts[5]}", {})[int(parts[4])] = data
        else:
            tensors[".".join(parts)] = data
    tensors.update({name: np.stack([per[e] for e in sorted(per)]) for name, per in experts.items()})
    for name, data in tensors.items():
        for gname, part in _deepseek_tensors(name, data.astype(np.float32), config):
            # the router float32; rows not of whole 32-value blocks too, as llama.cpp falls back for them
            plain = gname.endswith(("ffn_gate_inp.weight", "exp_probs_b.bias")) or part.shape[-1] % 32
            _add_tensor(w, gname, np.ascontiguousarray(part), "F32" if plain else type_name, rng)
    return _close(w, path)
