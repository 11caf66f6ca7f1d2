"""Write int4 copies of a float Hugging Face checkpoint in the AWQ, GPTQ and compressed-tensors pack-quantized
layouts, for `tokenmill eval quality MODEL --quantization int4,DIR...` rows on models no tool here quantized.

The values are plain round-to-nearest asymmetric int4 per group (no AWQ/GPTQ calibration: these rows measure
the formats' loading and the Q4_1 kernels, not the quantization algorithms), packed exactly as AutoAWQ (gemm),
AutoGPTQ (checkpoint_format gptq: zero - 1 stored, so zeros are clamped to 1..15) and compressed-tensors write
them, with their quantization_config. The LM head (and a tied embedding) stays float, as those tools leave it.

    python benchmarks/int4_checkpoints.py [--model DIR_OR_GGUF] [--group 128] --out DIR
prints the three folders (DIR/awq-g<group>, DIR/gptq-g<group>, DIR/ct-g<group>).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack8(v: np.ndarray, axis: int, order=tuple(range(8))) -> torch.Tensor:
    """Values 0..15 -> int32 words along axis: nibble i of word w holds element 8w + order[i]."""
    v = np.moveaxis(v.astype(np.uint32), axis, -1)
    out = np.zeros(v.shape[:-1] + (v.shape[-1] // 8,), np.uint32)
    for i, j in enumerate(order):
        out |= v[..., j::8] << np.uint32(4 * i)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(out, -1, axis)).view(np.int32))


def rtn(w: torch.Tensor, g: int, zero_range=(0, 15)):
    """[N, K] float -> q uint8 [N, K], scale fp16 [N, K/g], zero uint8 [N, K/g]: w ~= scale * (q - zero)."""
    N, K = w.shape
    x = w.float().reshape(N, K // g, g)
    lo, hi = x.amin(-1).clamp(max=0), x.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8).half()
    zero = torch.round(-lo / scale.float()).clamp(*zero_range)
    q = torch.round(x / scale.float()[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(N, K).to(torch.uint8).numpy(), scale.numpy(), zero.to(torch.uint8).numpy()


def quant_config(fmt: str, g: int) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm", "zero_point": True}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "group_size": g, "strategy": "group"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}}}


def tensors(fmt: str, w: torch.Tensor, g: int) -> dict[str, torch.Tensor]:
    q, s, z = rtn(w, g, (1, 15) if fmt == "gptq" else (0, 15))
    if fmt == "awq":
        return {"qweight": pack8(q.T, 1, AWQ_ORDER), "qzeros": pack8(z.T, 1, AWQ_ORDER),
                "scales": torch.from_numpy(np.ascontiguousarray(s.T))}
    if fmt == "gptq":
        return {"qweight": pack8(q.T, 0), "qzeros": pack8(z.T - 1, 1), "scales": torch.from_numpy(np.ascontiguousarray(s.T)),
                "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // g}
    return {"weight_packed": pack8(q, 1), "weight_scale": torch.from_numpy(s), "weight_zero_point": pack8(z, 0),
            "weight_shape": torch.tensor(w.shape)}


def write(src: str, dst: str, fmt: str, g: int) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"), dirs_exist_ok=True)
    out = {}
    for f in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
        for name, t in load_file(os.path.join(src, f)).items():
            base = name.removesuffix(".weight")
            if name.endswith(".weight") and base.rpartition(".")[2] in PROJ:
                out.update({f"{base}.{k}": v for k, v in tensors(fmt, t, g).items()})
            else:
                out[name] = t.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = quant_config(fmt, g)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="float HF dir or .gguf (default: the default model's HF form)")
    ap.add_argument("--group", type=int, default=None,
                    help="group size (default: the largest of 128, 64, 32 that divides the hidden and intermediate "
                         "sizes; SmolLM2-135M's hidden 576 takes 64)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tokenmill.models.resolution import resolve_model_path

    src = resolve_model_path(args.model, gguf_weights="dequantize")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    group = args.group or next(g for g in (128, 64, 32)
                               if cfg["hidden_size"] % g == 0 and cfg["intermediate_size"] % g == 0)
    for fmt in ("awq", "gptq", "ct"):
        print(write(src, os.path.join(args.out, f"{fmt}-g{group}"), fmt, group))


if __name__ == "__main__":
    main()
