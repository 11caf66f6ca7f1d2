"""`tokenmill quantize MODEL --method fp8 --out DIR`: write a pre-quantized checkpoint others can load too.

Formats written (the layouts published for Llama/Qwen quantized models, which models.loader reads back):
- `--method fp8` (default `--format compressed-tensors`): float-quantized E4M3 `weight` with a float32
  per-channel `weight_scale` [N, 1], dynamic per-token activations — exactly what `--quantization fp8` does on
  load, so both give the same outputs;
- `--method fp8 --format fp8`: `quantization_config.quant_method = "fp8"` with 128x128 block scales
  (`weight_scale_inv`), the Qwen3/DeepSeek FP8 layout;
- `--method int8` / `w8a8`: compressed-tensors int-quantized int8 `weight` + per-channel `weight_scale`
  (w8a8 adds dynamic per-token int8 input activations).
Linear weights (q/k/v/o, gate/up/down and the LM head) are quantized; embeddings and norms keep their dtype.
A tied LM head is written as its own quantized `lm_head.weight` (tie_word_embeddings becomes false) unless
`--keep-lm-head`, which leaves it in float and lists it under `ignore`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Optional

import torch
from safetensors.torch import save_file

from tokenmill.layers.quantization.int8 import quantize_int8
from tokenmill.models.loader import iter_weights, weight_files

logger = logging.getLogger("tokenmill")

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXPORT_METHODS = ("fp8", "int8", "w8a8")
SHARD_BYTES = 4 * 2**30


def _is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    parts = name.split(".")
    return tensor.dim() == 2 and parts[-1] == "weight" and len(parts) >= 2 and parts[-2] in LINEAR_NAMES


def _quantization_config(method: str, fmt: str, block: tuple[int, int], ignore: list[str]) -> dict:
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "ignored_layers": ignore}
    is_float = method == "fp8"
    weights = {"num_bits": 8, "type": "float" if is_float else "int", "strategy": "channel", "symmetric": True,
               "dynamic": False, "group_size": None, "block_structure": None, "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float" if is_float else "int", "strategy": "token", "symmetric": True,
            "dynamic": True, "group_size": None, "block_structure": None, "observer": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized" if is_float else "int-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts if method != "int8" else None,
                                          "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


def _quantize(method: str, fmt: str, block: tuple[int, int], name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    base = name[: -len(".weight")]
    if method == "fp8":
        from tokenmill.layers.quantization.fp8 import quantize_fp8  # ~2 ms: `quantize --help` imports this module

        if fmt == "fp8":
            q, scale = quantize_fp8(w, block)
            return {name: q, f"{base}.weight_scale_inv": scale.contiguous()}
        q, scale = quantize_fp8(w)
        return {name: q, f"{base}.weight_scale": scale.reshape(-1, 1).contiguous()}
    q, scale = quantize_int8(w)
    return {name: q, f"{base}.weight_scale": scale.reshape(-1, 1).contiguous()}


def _check_export(method: str, fmt: str) -> None:
    if method not in EXPORT_METHODS:
        raise ValueError(f"cannot export --method {method!r}: tokenmill writes {', '.join(EXPORT_METHODS)} "
                         "checkpoints (mxfp4/nvfp4 quantize on load only)")
    if fmt not in ("compressed-tensors", "fp8"):
        raise ValueError(f"unknown checkpoint format {fmt!r}; choose compressed-tensors or fp8")
    if fmt == "fp8" and method != "fp8":
        raise ValueError("--format fp8 holds fp8 weights only; use --format compressed-tensors for int8/w8a8")


def _write_checkpoint(src: str, out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """The tensors, config.json, and every other file of the source (tokenizer, generation config, chat
    template ...) beside them."""
    _save(tensors, out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if (os.path.isfile(path) and not name.endswith(".safetensors") and name not in
                ("config.json", "model.safetensors.index.json")):
            shutil.copy2(path, os.path.join(out_dir, name))


def export_quantized(model: Optional[str], out_dir: str, method: str = "fp8", fmt: str = "compressed-tensors",
                     keep_lm_head: bool = False, block: tuple[int, int] = (128, 128)) -> str:
    """Quantize a float checkpoint (HF directory or GGUF) into out_dir. Returns out_dir."""
    from tokenmill.models.resolution import resolve_model_path  # config (~11 ms): `quantize --help` skips it

    _check_export(method, fmt)
    src = resolve_model_path(model)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if os.path.abspath(src) == os.path.abspath(out_dir):
        raise ValueError("--out must differ from the model directory")
    os.makedirs(out_dir, exist_ok=True)

    tied = bool(config.get("tie_word_embeddings", False))
    tensors: dict[str, torch.Tensor] = {}
    embed = head = None
    for name, t in iter_weights(weight_files(src)):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "model.embed_tokens.weight":
            embed = t
        if name == "lm_head.weight":
            head = t
            if tied:
                continue
            if not keep_lm_head:
                tensors.update(_quantize(method, fmt, block, name, t))
                continue
        if _is_linear_weight(name, t):
            tensors.update(_quantize(method, fmt, block, name, t))
        else:
            tensors[name] = t.contiguous()
    ignore = []
    if keep_lm_head:
        ignore.append("lm_head")
    elif tied:
        source = head if head is not None else embed
        if source is None:
            raise ValueError(f"{src}: tied embeddings but no model.embed_tokens.weight to quantize the head from")
        tensors.update(_quantize(method, fmt, block, "lm_head.weight", source))
        config["tie_word_embeddings"] = False
    config["quantization_config"] = _quantization_config(method, fmt, block, ignore)

    _write_checkpoint(src, out_dir, tensors, config)
    logger.info("wrote %s checkpoint (%s) to %s", method, fmt, out_dir)
    return out_dir


def _save(tensors: dict[str, torch.Tensor], out_dir: str) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata=meta)
        weight_map.update({n: fname for n in shard})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write a pre-quantized (fp8, int8, w8a8) copy of a float checkpoint")
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="fp8", help=f"one of {', '.join(EXPORT_METHODS)} (default fp8)")
    p.add_argument("--format", dest="checkpoint_format", default="compressed-tensors",
                   choices=["compressed-tensors", "fp8"],
                   help="compressed-tensors: per-channel scales (what --quantization does on load); fp8: "
                        "quant_method fp8 with 128x128 block scales")
    p.add_argument("--keep-lm-head", action="store_true", help="leave the LM head unquantized")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=lambda a: export_quantized(a.model, a.out, a.method, a.checkpoint_format,
                                                   a.keep_lm_head) and 0)
