"""Mixture-of-experts families on the Llama decoder: Mixtral and Qwen3-MoE.

They differ from llama.py only in the feed-forward block (layers/fused_moe.FusedMoE instead of the dense MLP)
and in the checkpoint names of the experts. Semantics follow transformers' modeling_mixtral.py and
modeling_qwen3_moe.py:
- Mixtral: every layer is MoE; softmax over all experts, top-k, always renormalised (= softmax over the
  top-k logits); the float32 routing weights scale the expert outputs.
- Qwen3-MoE: layer i is MoE unless i is in `mlp_only_layers` or (i + 1) % `decoder_sparse_step` != 0 (those
  keep a dense MLP of `intermediate_size`); experts have `moe_intermediate_size`; renormalised only if
  `norm_topk_prob`; routing weights cast to the model dtype. Its q/k norm is llama.py's (keyed on model_type).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.models.llama import MLP, LlamaForCausalLM

# HF per-expert tensors (Mixtral: block_sparse_moe.experts.E.w1|w2|w3; Qwen: mlp.experts.E.gate_proj|...)
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# transformers 5's stacked layout: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]
_STACKED = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_PROJ = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def _num_experts(config) -> int:
    # transformers 5 maps Qwen's num_experts and Mixtral's num_local_experts onto each other; read either
    return getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0


class MoEForCausalLM(LlamaForCausalLM):
    """Shared by the MoE families: expert loading and the expert-load counters."""

    def moe_layers(self) -> list[FusedMoE]:
        return [layer.mlp for layer in self.layers if isinstance(getattr(layer, "mlp", None), FusedMoE)]

    def expert_load(self) -> Optional[torch.Tensor]:
        """[num_moe_layers, num_experts] int64: tokens routed to each expert since the last call (then
        reset). Global on every rank, also under expert parallelism (every rank sees all routing)."""
        layers = self.moe_layers()
        if not layers:
            return None
        return torch.stack([m.take_expert_load() for m in layers]).cpu()

    def _moe_layer(self, name: str, idx: str) -> Optional[FusedMoE]:
        """Layer idx's FusedMoE, or None where another pipeline stage holds the layer."""
        local = int(idx) - getattr(self, "start_layer", 0)  # this stage's layers (llama.py's layer_range)
        if not 0 <= local < len(self.layers):
            if 0 <= int(idx) < self.config.num_hidden_layers:
                return None
            raise ValueError(f"checkpoint tensor {name!r}: layer {idx} is past the model's "
                             f"{self.config.num_hidden_layers} layers")
        mlp = getattr(self.layers[local], "mlp", None)
        if not isinstance(mlp, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}: "
                             f"layer {idx} is not a mixture-of-experts layer")
        return mlp

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Expert tensors go to their FusedMoE layer, which reads only this rank's experts (or their slices)
        of them; the rest, with Mixtral's `block_sparse_moe` renamed to our `mlp`, to llama.py's loader."""
        def dense():
            for name, tensor in weights:
                m = _EXPERT.match(name) or _STACKED.match(name)
                if m is None:
                    yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                    continue
                moe = self._moe_layer(name, m[1])
                if moe is None:
                    continue
                if m.re is _EXPERT:
                    moe.load_expert(int(m[2]), _PROJ[m[3]], tensor)
                else:
                    moe.load_stacked(m[2], tensor)

        loaded = super().load_weights(dense())
        for i, layer in enumerate(self.layers):
            mlp = getattr(layer, "mlp", None)
            if isinstance(mlp, FusedMoE) and mlp.experts_loaded():  # incomplete: the loader names them missing
                # the experts' own tensors (the gate and any shared experts are submodules, loaded by name)
                loaded |= {f"layers.{i}.mlp.{n}" for n, _ in mlp.named_parameters(recurse=False)}
        return loaded


class MixtralForCausalLM(MoEForCausalLM):
    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        return FusedMoE(_num_experts(config), config.num_experts_per_tok, config.hidden_size,
                        config.intermediate_size, dtype, renormalize=True, float32_scores=True)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        experts = _num_experts(config)
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        if experts == 0 or layer_idx in dense_only or (layer_idx + 1) % step:
            return MLP(config, dtype)
        return FusedMoE(experts, config.num_experts_per_tok, config.hidden_size, config.moe_intermediate_size,
                        dtype, renormalize=bool(getattr(config, "norm_topk_prob", False)), float32_scores=False)
