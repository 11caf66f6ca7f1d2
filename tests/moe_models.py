"""A real-weights mixture of experts for tests, built from the default model (DESIGN.md section 5a).

No MoE checkpoint ships offline, so SmolLM2-135M-Instruct (its GGUF, converted to an HF directory by
tokenmill.models.gguf) becomes a Mixtral-layout model: each layer's MLP copied into NUM_EXPERTS experts, each
weight multiplied elementwise by (1 + JITTER * N(0, 1)), and a seeded random router, top-2. Since every expert is close to
the original MLP and the top-2 weights are renormalised, the text stays coherent, while the experts differ
enough (2%) that routing to the wrong experts changes the logits.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import Optional

import numpy as np
import torch

NUM_EXPERTS = 4
TOP_K = 2
JITTER = 0.02
SEED = 17
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                    "special_tokens_map.json")
_path: Optional[str] = None


def _experts(tensors: dict, noise: dict, router: torch.Tensor, layer: int) -> dict:
    """Layer `layer`'s MLP tensors replaced by its router and NUM_EXPERTS jittered copies, Mixtral names."""
    prefix = f"model.layers.{layer}."
    mlp = {name: tensors.pop(f"{prefix}mlp.{name}_proj.weight") for name in ("gate", "up", "down")}
    out = {f"{prefix}block_sparse_moe.gate.weight": router[layer]}
    for e in range(NUM_EXPERTS):
        for hf, ours in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
            out[f"{prefix}block_sparse_moe.experts.{e}.{hf}.weight"] = mlp[ours] * noise[e, ours]
    return out


def smollm2_moe() -> str:
    """Path of the SmolLM2-derived Mixtral directory (float32 safetensors; built once per session). Raises
    RuntimeError where the default model is not installed."""
    global _path
    if _path is not None:
        return _path
    from safetensors.torch import load_file, save_file

    from tokenmill.models.default_model import default_model_path
    from tokenmill.models.gguf import gguf_to_hf_dir

    src = gguf_to_hf_dir(default_model_path())
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(SEED)
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    router = torch.randn(layers, NUM_EXPERTS, hidden, generator=g) * hidden ** -0.5
    # one multiplicative noise pattern per (expert, projection), shared by the layers: generating 320M
    # Gaussians took longer than the rest of the build
    shapes = {name: tensors[f"model.layers.0.mlp.{name}_proj.weight"].shape for name in ("gate", "up", "down")}
    noise = {(e, name): 1 + JITTER * torch.randn(shape, generator=g) for e in range(NUM_EXPERTS)
             for name, shape in shapes.items()}
    for layer in range(layers):
        tensors.update(_experts(tensors, noise, router, layer))
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=NUM_EXPERTS,
                  num_experts_per_tok=TOP_K, router_jitter_noise=0.0, sliding_window=None, torch_dtype="float32")
    config.pop("tokenmill_source", None)
    path = tempfile.mkdtemp(prefix="tokenmill-smollm2-moe-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # 1.4 GB: gone with the session, not left in /tmp
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), path)
    _path = path
    return path


# -- a tiny MoE as a GGUF file (what llama.cpp's converter writes), for the GGUF loader --------------------------
_GGUF_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen3_moe_norm": "qwen3moe"}
_GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp"}
_GGUF_EXPERTS = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps", "up_proj": "ffn_up_exps",
                 "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}


def _llama_cpp_permute(w, n_head: int):
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: HF's rotary halves -> interleaved pairs
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf_dir: str, config: dict, arch: str) -> dict:
    """HF tensors -> GGUF names (experts stacked per projection, llama's Q/K rows permuted), numpy float32."""
    from safetensors.torch import load_file

    out, experts = {}, {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        w = t.float().numpy()
        name = name.removeprefix("model.")
        if name in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            out[{"embed_tokens": "token_embd", "norm": "output_norm", "lm_head": "output"}[name.split(".")[0]]
                + ".weight"] = w
            continue
        parts = name.split(".")  # layers.i.<module...>.weight
        layer, module = parts[1], ".".join(parts[2:-1])
        if ".experts." in name:  # layers.i.<block>.experts.e.<proj>.weight
            experts.setdefault((layer, _GGUF_EXPERTS[parts[-2]]), {})[int(parts[-3])] = w
            continue
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads" if module.endswith("q_proj") else "num_key_value_heads"]
            w = _llama_cpp_permute(w, heads)
        out[f"blk.{layer}.{_GGUF_LAYER[module]}.weight"] = w
    for (layer, stack), per_expert in experts.items():
        out[f"blk.{layer}.{stack}.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def add_gpt2_tokenizer(w, tok) -> None:
    """The tiny models' byte-level BPE as llama.cpp's converter writes a gpt2 tokenizer into a GGUF."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)


def tiny_moe_gguf(hf_dir: str, moe_arch: str, ggml_type: Optional[str] = None) -> str:
    """A GGUF file (float32 tensors, the tiny tokenizer's BPE in the metadata) of the tiny model `hf_dir`;
    ggml_type (a type gguf-py quantizes, e.g. Q8_0): the weight matrices and expert stacks in it instead (the
    router stays float32, as llama.cpp keeps it)."""
    import gguf
    from gguf_models import add_base_metadata  # here: gguf_models imports this module
    from transformers import AutoTokenizer

    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    arch = _GGUF_ARCH[moe_arch]
    path = os.path.join(tempfile.mkdtemp(prefix="tokenmill-moe-gguf-"), f"{moe_arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    add_base_metadata(w, config, config["num_key_value_heads"])
    w.add_key_length(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_expert_count(config["num_local_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_weights_norm(config["norm_topk_prob"])
    add_gpt2_tokenizer(w, AutoTokenizer.from_pretrained(hf_dir))
    for name, data in _gguf_tensors(hf_dir, config, arch).items():
        if ggml_type is not None and data.ndim >= 2 and "ffn_gate_inp" not in name:
            kind = gguf.GGMLQuantizationType[ggml_type]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), kind), raw_dtype=kind)
            continue
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
