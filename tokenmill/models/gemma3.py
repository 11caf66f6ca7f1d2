"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`, model_type `gemma3_text`; GGUF architecture `gemma3`) on the
Llama decoder's pieces. Semantics follow transformers' modeling_gemma3.py:

- Layers interleave sliding-window (local) and full (global) attention (`layer_types`; transformers derives it
  from the older `sliding_window_pattern`), each type with its own rope (llama.py builds one table per type:
  layers/rotary.rope_layer_type). The window is config.layer_window's.
- Every norm is Gemma's (1 + w) RMSNorm (layers/norm.GemmaRMSNorm), q and k included, and a layer has four:
  input and post-attention around the attention, pre- and post-feedforward around the MLP; the residual adds
  the post-norms' outputs. Here the add is left to the next norm, as in llama.py: the layer returns
  (post-feedforward output, residual) and the next layer's input norm (or the final norm) adds them.
- Attention scores are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5.
- The embedding is multiplied by sqrt(hidden_size) rounded to the model dtype (as HF does: bf16 rounds it).
- The MLP is GELU-tanh gated (llama.py's MLP reads `hidden_activation`); the LM head is tied.
- final_logit_softcapping, where set, caps the logits (cap * tanh(logits / cap)); Gemma 3 sets none.
  attn_logit_softcapping (Gemma 2's) and bidirectional attention are refused.

The local and global layers are in separate KV groups (step/kv_groups.py): the local layers' blocks go back to
the pool as they leave the window.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.layers.norm import GemmaRMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import MLP, Attention, LlamaForCausalLM


class Gemma3Attention(Attention):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, dtype, backend, rotary)
        self.scale = config.query_pre_attn_scalar ** -0.5
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, layer_idx, dtype, backend, rotary)
        self.mlp = MLP(config, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata,
                kv_cache: torch.Tensor):
        """(x, residual) in, (this layer's MLP output after its post-norm, residual) out: the caller adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, meta, kv_cache))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    # models/cpu_stack.py: decoder_stack.c runs Llama's layer (two plain norms, SiLU, one rope table)
    cpu_stack_unsupported = ("Gemma 3 layers (four (1 + w) norms per layer, GELU MLP, a rope per layer type) "
                             "are not in the C decoder stack; they run layer by layer")

    def __init__(self, config, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        _check_supported(config)
        super().__init__(config, dtype, backend, max_positions, layer_range)
        # HF: torch.tensor(sqrt(hidden)) (float32) cast to the weight's dtype, then a multiply in that dtype
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5).to(dtype), persistent=False)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def make_layer(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                   rotary: RotaryEmbedding) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_idx, dtype, backend, rotary)

    def make_norm(self, config, dtype: torch.dtype) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        # in float32 (HF caps in the model dtype: the same numbers in float32, llama.cpp's in every dtype)
        return logits if not cap else torch.tanh(logits / cap) * cap


def _check_supported(config) -> None:
    """One-line errors for the Gemma-family variants this decoder does not implement."""
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"Gemma attn_logit_softcapping={config.attn_logit_softcapping} is not supported (Gemma 2's "
                         "capped attention scores; Gemma 3 does not set it)")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder, e.g. EmbeddingGemma) is not "
                         "supported: tokenmill serves it as a causal decoder only")
