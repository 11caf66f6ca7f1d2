"""gpt-oss (HF `GptOssForCausalLM`, model_type `gpt_oss`) on the Llama decoder's pieces. Semantics follow
transformers' modeling_gpt_oss.py:

- Layers alternate sliding-window and full attention (`layer_types`, `sliding_window`): two KV groups
  (step/kv_groups.py), the sliding layers' blocks given back as they leave the window. q/k/v/o have biases
  (`attention_bias`); one YaRN rope for all layers (layers/rotary.py, from transformers' initialisers).
- Learned attention sinks: one logit per query head that joins every softmax's denominator and weights no
  value (`self_attn.sinks`; the attention backends take them, layers/attention).
- Every layer's feed-forward block is a mixture of experts (layers/fused_moe.FusedMoE): a router with a bias,
  the top-k logits then a softmax over just those, experts with biases and the clamped SwiGLU
  (activation.ClampedSwiGLU: `swiglu_alpha`, `swiglu_limit`).
- Expert tensors, stacked over experts with gate and up interleaved row by row (gate j at 2j, up j at 2j + 1):
  float (transformers' own layout, transposed: `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]), or MXFP4 as
  OpenAI ships them (config.json `quantization_config.quant_method` "mxfp4": `*_blocks` [E, rows, K/32, 16]
  E2M1 pairs, `*_scales` [E, rows, K/32] E8M0, rows as nn.Linear's), served natively by
  quantization/fp4.Mxfp4MoEMethod; `*_bias` float either way. The loader puts gate rows then up rows
  (FusedMoE's w13 layout) and reads only this rank's experts.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable, Optional

import torch
from torch import nn

from tokenmill.layers.activation import ClampedSwiGLU
from tokenmill.layers.attention.base import AttentionBackend
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.linear import narrow
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import Attention, DecoderLayer
from tokenmill.models.moe import MoEForCausalLM

logger = logging.getLogger("tokenmill")

_EXPERTS = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales|_bias)?$")
# checkpoint suffix -> FusedMoE parameter suffix
_PARAM = {"": "_weight", "_blocks": "_weight", "_scales": "_scale", "_bias": "_bias"}


class GptOssAttention(Attention):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, dtype, backend, rotary)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)  # this rank's heads

    def load_shard(self, param: nn.Parameter, loaded, shard: int) -> None:
        """The checkpoint's sinks [heads]: this rank's heads."""
        start, size = self.qkv_proj.sharding.out_ranges[0]
        part = narrow(loaded, 0, start // self.head_dim, size // self.head_dim)
        if tuple(part.shape) != tuple(param.shape):
            heads = self.qkv_proj.sharding.full_sizes[0] // self.head_dim
            raise ValueError(f"shape {tuple(loaded.shape)}, expected ({heads},)")
        param.data.copy_(part)


class GptOssForCausalLM(MoEForCausalLM):
    # models/cpu_stack.py: decoder_stack.c runs Llama's dense layer with plain softmax attention
    cpu_stack_unsupported = ("gpt-oss layers (attention sinks, mixture-of-experts MLP) are not in the C decoder "
                             "stack; they run layer by layer")

    def __init__(self, config, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__(config, dtype, backend, max_positions, layer_range)
        logger.info("gpt-oss: attention sinks run in the paged decode kernel; prefill chunks run unfused torch "
                    "attention (SDPA has no sink logit)")

    def make_layer(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                   rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(config, layer_idx, dtype, backend, rotary, self.make_mlp(config, layer_idx, dtype),
                            GptOssAttention(config, layer_idx, dtype, backend, rotary))

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        act = ClampedSwiGLU(getattr(config, "swiglu_alpha", 1.702), config.swiglu_limit)
        return FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                        config.intermediate_size, dtype, renormalize=False, float32_scores=False,
                        topk_softmax=True, bias=True, act=act)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        # transformers names the router mlp.router; FusedMoE's is mlp.gate (Mixtral's name)
        return super().load_weights((name.replace(".mlp.router.", ".mlp.gate."), t) for name, t in weights)

    def load_expert_tensor(self, name: str, tensor) -> bool:
        m = _EXPERTS.match(name)
        if m is None:
            return False
        moe = self._moe_layer(name, m[1])
        if moe is not None:
            kind = m[3] or ""
            if kind in ("_blocks", "_scales") and not hasattr(moe, "w13_scale"):
                raise ValueError(f"checkpoint tensor {name!r} is MXFP4 but config.json has no quantization_config "
                                 "with quant_method 'mxfp4'")
            _load_experts(moe, m[2], kind, tensor)
        return True


def _load_experts(moe: FusedMoE, proj: str, kind: str, tensor) -> None:
    """One stacked expert tensor (see the module doc) into moe's parameters: this rank's experts, and of each
    its width slice (gate/up rows, down columns)."""
    name = ("w13" if proj == "gate_up_proj" else "w2") + _PARAM[kind]
    n, r = moe.intermediate_size, moe.intermediate_rank
    for e in range(moe.num_experts):
        if not moe.holds(e):
            continue
        t = tensor[e]  # reads this expert only
        if kind == "":
            t = t.t()  # transformers' [in, out] -> [out, in]
        elif kind == "_blocks":
            t = t.reshape(t.shape[0], -1)  # [rows, K/32, 16] -> [rows, K/2] bytes, as fp4_codec packs them
        if proj == "gate_up_proj":
            for half, rows in enumerate((t[0::2], t[1::2])):
                moe.copy_rows(name, e, half * n, rows[r * n:(r + 1) * n])
        elif kind == "_bias":  # this rank's columns where the width is split (FusedMoE.bias_cols)
            c0, width = moe.bias_cols or (0, t.shape[0])
            moe.copy_rows(name, e, 0, t[c0:c0 + width])
        else:  # down: its columns (K units of 1 value, 1/2 byte or 1/32 scale) of this rank's width
            width = t.shape[1] * n // moe.full_intermediate_size
            moe.copy_rows(name, e, 0, t[:, r * width:(r + 1) * width])
