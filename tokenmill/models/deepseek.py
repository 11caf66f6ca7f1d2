"""DeepSeek-V2 and -V3 (HF `DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`) on the Llama decoder's pieces.
Semantics follow transformers' modeling_deepseek_v2.py and modeling_deepseek_v3.py:

- Multi-head latent attention (`MLAttention`, the math in layers/attention/mla.py): q from q_a_proj ->
  q_a_layernorm -> q_b_proj (or one q_proj where q_lora_rank is None, as V2-Lite); kv_a_proj_with_mqa gives the
  latent (kv_lora_rank, then kv_a_layernorm) and one rope key k_pe shared by the heads; kv_b_proj expands the
  latent to each head's k_nope and v. Rope covers only the qk_rope_head_dim dims, in interleaved pairs (V2
  always, V3 unless rope_interleave is false). The softmax scale is qk_head_dim^-0.5, times YaRN's
  mscale(factor, mscale_all_dim)^2 under YaRN. The two norms inside attention use eps 1e-6 (transformers'
  default: it does not pass rms_norm_eps to them).
- The KV cache holds the latent and k_pe per token and layer (kv_lora_rank + qk_rope_head_dim values), not K/V.
- The first `first_k_dense_replace` layers keep a dense MLP; the others are MoE with `n_shared_experts` shared
  experts (one MLP of n_shared x moe_intermediate_size) added to the routed ones. Routing (layers/fused_moe
  GroupedTopK): V3 scores with a sigmoid, adds e_score_correction_bias for the choice, keeps the topk_group
  best of n_group groups (each scored by its two best experts) and renormalises if norm_topk_prob; V2 scores
  with a softmax and picks greedily (topk_method "greedy") or within the best groups by their best expert
  ("group_limited_greedy"), and never renormalises (transformers' V2 reads no norm_topk_prob). Both scale the
  weights by routed_scaling_factor.
- V3 checkpoints' multi-token-prediction layers (model.layers.{num_hidden_layers}...) are not loaded, as in
  transformers. Pre-quantized checkpoints (the official FP8 release) are refused for now: kv_b_proj is a plain
  weight here (the absorbed decode multiplies by its halves) and would need its block scales applied on load.

GGUF files (llama.cpp's `deepseek2`) are read by models/gguf.py into the same config and tensor names.

Under tensor parallel the heads split (q_b/q_proj, kv_b by heads, o_proj by rows) and the latent path (q_a,
kv_a, their norms) and the latent cache are replicated on every rank.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from tokenmill.distributed import tp_rank, tp_size
from tokenmill.layers.attention import mla
from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.layers.fused_moe import FusedMoE, GroupedTopK
from tokenmill.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, yarn_softmax_scale
from tokenmill.models.llama import MLP, DecoderLayer, attention_tp_size
from tokenmill.models.moe import MoEForCausalLM

_LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its default eps


class MLAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, rotary: RotaryEmbedding) -> None:
        super().__init__()
        replicated = attention_tp_size(config) == 1
        tp, rank = (1, 0) if replicated else (tp_size(), tp_rank())
        heads, h = config.num_attention_heads, config.hidden_size
        if heads % tp:
            raise ValueError(f"{heads} attention heads cannot be split over tensor-parallel size {tp}")
        self.num_heads = heads // tp  # this rank's
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        qk = self.nope + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [heads * qk], False, dtype, replicated=replicated)
        else:
            self.q_proj = ColumnParallelLinear(h, [heads * qk], False, dtype, replicated=replicated)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        self.kv_b_proj = mla.LatentUpProjection(self.kv_lora_rank, self.num_heads, self.nope, self.v_dim,
                                                rank * self.num_heads, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, h, bias, dtype, replicated=replicated)
        self.scale = qk ** -0.5 * yarn_softmax_scale(config)
        self.rotary = rotary
        self.layer_idx = layer_idx  # of the whole model: it names the layer's KV group (meta.for_layer)
        self.window = None
        self.attention_path = mla.PATH  # the kernels report's entry

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return mla.latent_cache_shape(num_blocks, block_size, self.kv_lora_rank, self.rope_dim)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.num_heads, -1).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # fresh, dense copies: the rope may rotate them in place
        q_pe, k_pe = self.rotary(meta.positions, q_pe.contiguous(), k_pe.reshape(T, 1, self.rope_dim).contiguous(),
                                 meta.cache)
        o = mla.mla_forward(q_nope, q_pe, latent, k_pe[:, 0], kv_cache, meta.for_layer(self.layer_idx),
                            self.kv_b_proj, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * self.v_dim))


class DeepseekMoE(FusedMoE):
    """The routed experts (FusedMoE with DeepSeek's grouped routing) plus the shared experts' MLP."""

    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                         config.moe_intermediate_size, dtype, renormalize=_renormalizes(config),
                         float32_scores=True, grouped=_routing(config))
        shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = MLP(config, dtype, shared * config.moe_intermediate_size) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def _is_v3(config) -> bool:
    return config.model_type == "deepseek_v3"


def _renormalizes(config) -> bool:
    return _is_v3(config) and bool(getattr(config, "norm_topk_prob", False))


def _routing(config) -> GroupedTopK:
    scale = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
    groups, topk_groups = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
    if _is_v3(config):
        return GroupedTopK(sigmoid=True, num_groups=groups, topk_groups=topk_groups, group_score="top2",
                           correction_bias=True, scaling_factor=scale)
    method = getattr(config, "topk_method", "greedy")
    if method == "greedy":
        return GroupedTopK(sigmoid=False, scaling_factor=scale)
    if method == "group_limited_greedy":
        return GroupedTopK(sigmoid=False, num_groups=groups, topk_groups=topk_groups, group_score="max",
                           scaling_factor=scale)
    raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")


class DeepseekForCausalLM(MoEForCausalLM):
    # models/cpu_stack.py: decoder_stack.c runs Llama's attention over K/V heads, not a latent cache
    cpu_stack_unsupported = ("DeepSeek layers (latent attention over a compressed KV cache, grouped-top-k MoE) "
                             "are not in the C decoder stack; they run layer by layer")
    # checkpoint names merged into one of our linears: q_proj stays itself (V2-Lite's query projection)
    _MERGED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        _check_supported(config)
        super().__init__(config, dtype, backend, max_positions, layer_range)

    def make_rotary(self, config, max_positions: int, layer_type: Optional[str]) -> RotaryEmbedding:
        interleaved = bool(getattr(config, "rope_interleave", True)) if _is_v3(config) else True
        return RotaryEmbedding(config, config.qk_rope_head_dim, max_positions, layer_type, interleaved=interleaved)

    def make_layer(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                   rotary: RotaryEmbedding) -> nn.Module:
        return DecoderLayer(config, layer_idx, dtype, backend, rotary, self.make_mlp(config, layer_idx, dtype),
                            attn=MLAttention(config, layer_idx, dtype, rotary))

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        if layer_idx < (getattr(config, "first_k_dense_replace", 0) or 0) or not config.n_routed_experts:
            return MLP(config, dtype)
        return DeepseekMoE(config, dtype)

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """V3's multi-token-prediction layers (past num_hidden_layers) are skipped, as transformers skips them."""
        n = self.config.num_hidden_layers

        def decoder_only():
            for name, tensor in weights:
                parts = name.removeprefix("model.").split(".")
                if parts[0] == "layers" and int(parts[1]) >= n:
                    continue
                yield name, tensor

        return super().load_weights(decoder_only())


def _check_supported(config) -> None:
    """One-line errors for the DeepSeek variants this decoder does not implement."""
    freq = getattr(config, "moe_layer_freq", 1) or 1
    if freq != 1:
        raise ValueError(f"DeepSeek moe_layer_freq={freq} is not supported (every layer after "
                         "first_k_dense_replace is MoE, as in transformers and every released model)")
    quant = getattr(config, "quantization_config", None)
    if quant:  # e.g. the official FP8 release: kv_b_proj would need its block scales applied on load
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", quant)
        raise ValueError(f"pre-quantized DeepSeek checkpoints ({method}) are not supported yet; serve a bfloat16 "
                         "checkpoint, optionally with --quantization int8 or fp8")
