"""Rotary position embedding (neox/HF-llama layout: the two halves of head_dim rotate together).
inv_freq comes from transformers' own rope initialisers, so every rope_type the config names
(default, linear, dynamic-free llama3, yarn, longrope...) matches the reference.

Gemma 3 gives each layer type its own rope: transformers 5 nests the parameters by layer type
(`rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}`); older configs say
`rope_local_base_freq` for the sliding layers and `rope_theta` (+ `rope_scaling`) for the full ones.
`rope_layer_type` names the variant a layer uses (None: one rope for every layer).

DeepSeek rotates interleaved pairs (x0, x1), (x2, x3)... instead of the two halves (`interleaved`), and with
YaRN scales its attention softmax too (`yarn_softmax_scale`)."""
from __future__ import annotations

import math

from typing import Optional

import torch
from torch import nn

from tokenmill.config_snapshot import ConfigSnapshot
from tokenmill.layers import cpu_fused


_LAYER_TYPES = ("sliding_attention", "full_attention")


def rope_layer_type(config, layer_idx: int) -> Optional[str]:
    """The layer type whose rope layer layer_idx uses, where the config gives layer types their own (Gemma 3);
    None where one rope serves every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = any(isinstance(params.get(t), dict) for t in _LAYER_TYPES)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and (nested or getattr(config, "rope_local_base_freq", None) is not None):
        return layer_types[layer_idx]
    return None


def _rope_parameters(config, layer_type: Optional[str] = None) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        if isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        elif layer_type == "sliding_attention":  # older Gemma 3 configs: no scaling on the local layers
            params = {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def yarn_softmax_scale(config) -> float:
    """The factor DeepSeek's YaRN puts on the attention softmax scale, mscale(factor, mscale_all_dim) squared
    (transformers' yarn_apply_mscale); 1 without YaRN or without mscale_all_dim."""
    params = _rope_parameters(config)
    mscale_all_dim, factor = params.get("mscale_all_dim"), params.get("factor", 1.0)
    if params["rope_type"] == "default" or not mscale_all_dim or factor <= 1:
        return 1.0
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return mscale * mscale


def compute_inv_freq(config, head_dim: int, layer_type: Optional[str] = None) -> tuple[torch.Tensor, float]:
    params = _rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type in ("default", "linear"):  # linear: positions divided by the factor, i.e. inv_freq
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return (inv_freq if rope_type == "default" else inv_freq / params["factor"]), 1.0
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported (it changes with sequence length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    if isinstance(config, ConfigSnapshot):  # the engine process's copy: transformers wants its own object
        config = config.original()
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    # on the device the model is being built on (the loader's torch.device context), like the default branch
    return inv_freq.float().to(torch.get_default_device()), float(scaling)


class RotaryEmbedding(nn.Module):
    """interleaved: pairs (x0, x1), (x2, x3)... rotate together (DeepSeek). They are gathered into halves first
    and the output stays in halves, as transformers' DeepSeek-V3 leaves it: q and k are permuted alike, so every
    q.k is the interleaved rotation's."""

    def __init__(self, config, head_dim: int, max_positions: int, layer_type: Optional[str] = None,
                 interleaved: bool = False) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(config, head_dim, layer_type)
        halves = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)]) if interleaved else None
        self.register_buffer("halves", halves, persistent=False)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, step_cache: dict):
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. cos/sin are gathered once per step, not per layer."""
        if self.halves is not None:  # fresh tensors: the in-place C rope below may write them
            q, k = q[..., self.halves], k[..., self.halves]
        if cpu_fused.rope_usable(q, k) and positions.device.type == "cpu":
            pos = positions if positions.dtype == torch.int64 else positions.long()
            cpu_fused.rope_(q, pos, self.cos, self.sin)  # in place: q and k are fresh (views of qkv)
            cpu_fused.rope_(k, pos, self.cos, self.sin)
            return q, k
        key = ("rope", id(self), q.dtype)
        cs = step_cache.get(key)
        if cs is None:
            cs = step_cache[key] = (self.cos[positions].unsqueeze(1).to(q.dtype),
                                    self.sin[positions].unsqueeze(1).to(q.dtype))
        return _rotate(q, *cs), _rotate(k, *cs)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (Qwen2-VL's M-RoPE): positions are [3, T] (temporal, height, width), and the head's
    rotary frequencies are split in config `mrope_section` runs, run i rotating by row i % 3's position. For text
    the three rows are equal and this is the plain rope; image tokens get their patch's (t, h, w)."""

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__(config, head_dim, max_positions)
        sections = (getattr(config, "rope_parameters", None) or {}).get("mrope_section")
        if not sections or sum(sections) != head_dim // 2:
            raise ValueError(f"mrope_section {sections} must split the head's {head_dim // 2} rotary frequencies")
        rows = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
        self.register_buffer("section_rows", rows, persistent=False)  # frequency j -> its position row

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, step_cache: dict):
        """positions [3, T] (a text-only [T] is every row the same)."""
        if positions.dim() == 1:
            return super().forward(positions, q, k, step_cache)
        key = ("mrope", id(self), q.dtype)
        cs = step_cache.get(key)
        if cs is None:
            pick = self.section_rows[None, None, :].expand(1, positions.shape[1], -1)  # [1, T, D/2]
            cs = step_cache[key] = tuple(table[positions].gather(0, pick)[0].unsqueeze(1).to(q.dtype)
                                         for table in (self.cos, self.sin))
        return _rotate(q, *cs), _rotate(k, *cs)
