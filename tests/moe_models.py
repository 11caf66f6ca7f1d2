"""A real-weights mixture of experts for tests, built from the default model (DESIGN.md section 5a).

No MoE checkpoint ships offline, so SmolLM2-135M-Instruct (its GGUF, converted to an HF directory by
tokenmill.models.gguf) becomes a Mixtral-layout model: each layer's MLP copied into NUM_EXPERTS experts, each
weight multiplied elementwise by (1 + JITTER * N(0, 1)), and a seeded random router, top-2. Since every expert is close to
the original MLP and the top-2 weights are renormalised, the text stays coherent, while the experts differ
enough (2%) that routing to the wrong experts changes the logits.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

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
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), path)
    _path = path
    return path
