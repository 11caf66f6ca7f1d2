"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the flat batch.

The families differ only in switches read from the HF config: q/k/v bias (Qwen2), per-head q/k RMSNorm
(Qwen3), explicit head_dim, sliding-window layers (Mistral, Qwen2), rope scaling (one rope per layer type
where the config nests it), the MLP's gated activation, tied embeddings. Families with another layer
structure build on the same pieces through make_layer / make_norm / embed (gemma3.py, moe.py's make_mlp).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from tokenmill.config import layer_window
from tokenmill.distributed import IntermediateTensors, stage_layers, state, tp_size
from tokenmill.layers.activation import gated_activation
from tokenmill.layers.attention.base import AttentionBackend, AttentionMetadata, paged_kv_shape
from tokenmill.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tokenmill.layers.linear import (ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, materialize,
                                    narrow)
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rope_layer_type
from tokenmill.models.cpu_stack import CpuStack


def _heads_divide(config, tp: int) -> bool:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)


def attention_tp_size(config) -> int:
    """Ranks attention is split over: the tensor-parallel size, or 1 (attention replicated on every rank, no
    all-reduce) when expert parallelism is on and the heads do not divide over the ranks: a MoE model's experts
    still shard, and replicated attention costs compute, not correctness."""
    tp = tp_size()
    if tp > 1 and state().expert_parallel and not _heads_divide(config, tp):
        return 1
    return tp


_QKV_BIAS_ONLY = ("qwen2", "qwen2_5_vl_text")  # q/k/v have biases, o_proj none


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        replicated = attention_tp_size(config) == 1
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim ** -0.5
        self.window = layer_window(config, layer_idx)
        self.layer_idx = layer_idx  # of the whole model: it names the layer's KV group (meta.for_layer)
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type in _QKV_BIAS_ONLY
        hd = self.head_dim
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, hd, config.num_attention_heads, num_kv_heads,
                                          bias=qkv_bias, dtype=dtype, replicated=replicated)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(config.num_attention_heads * hd, config.hidden_size,
                                        bias=(getattr(config, "attention_bias", False)
                                              and config.model_type not in _QKV_BIAS_ONLY),
                                        dtype=dtype, replicated=replicated)
        self.qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype)
        self.rotary = rotary
        self.backend = backend
        self.register_parameter("sinks", None)  # learned attention sinks [this rank's heads] (gpt-oss)
        self.kv_quant = None             # a KVCacheQuant when the cache is fp8/int8 (set by the worker)
        self.checkpoint_kv_scales = {}   # k_scale/v_scale tensors a checkpoint carries: {0: k, 1: v}

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """This layer's KV tensor (one per layer slot, step/kv_groups.py): K and V per KV head."""
        return paged_kv_shape(self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def load_kv_scale(self, which: int, loaded) -> None:
        """A checkpoint's k_scale (which=0) or v_scale (1): a scalar, or one per KV head (this rank's taken)."""
        if loaded.shape.numel() > 1:
            start, rows = self.qkv_proj.sharding.out_ranges[1]
            loaded = narrow(loaded, 0, start // self.head_dim, rows // self.head_dim)
        self.checkpoint_kv_scales[which] = materialize(loaded)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(meta.positions, q, k, meta.cache)
        o = self.backend.forward(q, k, v, kv_cache, meta.for_layer(self.layer_idx), self.scale, self.window,
                                 self.kv_quant, sinks=self.sinks)
        return self.o_proj(o.reshape(T, q_size))


class MLP(nn.Module):
    """intermediate_size: the config's unless given (DeepSeek's shared experts are one MLP of their own width)."""

    def __init__(self, config, dtype: torch.dtype, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [width] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias, dtype)
        # Gemma names it hidden_activation; the others hidden_act
        self.act = gated_activation(getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """attn: the family's attention block (default: Attention here; DeepSeek's latent attention)."""

    def __init__(self, config, layer_idx: int, dtype, backend, rotary, mlp: nn.Module,
                 attn: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.self_attn = attn if attn is not None else Attention(config, layer_idx, dtype, backend, rotary)
        self.mlp = mlp  # the family's feed-forward block: MLP here, a mixture of experts in moe.py
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x, residual, meta, kv_cache):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """layer_range: the [start, end) of decoder layers this pipeline stage builds (default: its even share,
    distributed.stage_layers). The first stage owns the embedding, the last the final norm and the LM head;
    the others have None there."""

    def __init__(self, config, dtype: torch.dtype, backend: AttentionBackend, max_positions: int,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        n = config.num_hidden_layers
        self.start_layer, self.end_layer = layer_range or stage_layers(n)
        if not 0 <= self.start_layer < self.end_layer <= n:
            raise ValueError(f"layer range {layer_range} is not a non-empty part of the model's {n} layers")
        first, last = self.start_layer == 0, self.end_layer == n
        rotaries: dict[Optional[str], RotaryEmbedding] = {}  # one table per rope variant, shared by its layers

        def rotary(i: int) -> RotaryEmbedding:
            kind = rope_layer_type(config, i)
            if kind not in rotaries:
                rotaries[kind] = self.make_rotary(config, max_positions, kind)
            return rotaries[kind]

        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype) if first else None
        self.layers = nn.ModuleList(self.make_layer(config, i, dtype, backend, rotary(i))
                                    for i in range(self.start_layer, self.end_layer))
        self.norm = self.make_norm(config, dtype) if last else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # A linear layer like the others, so a quant_method can quantize it (online quantization leaves it in
        # the model dtype unless --quantize-lm-head); tied, it starts out sharing the embedding's tensor
        # (quantizing the head then leaves the embedding's float copy for the gather). A tied head on a last
        # stage without the embedding loads the embedding's checkpoint tensor instead.
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype) if last else None
        if self.tie_word_embeddings and first and last:
            self.lm_head.weight = self.embed_tokens.weight
        # Short-query steps on CPU run the whole stack in one C call (cpu_stack.py); off: layer by layer.
        self.use_cpu_stack = True
        self._stack_for: Optional[list[torch.Tensor]] = None
        self._stack: Optional[CpuStack] = None

    def make_layer(self, config, layer_idx: int, dtype: torch.dtype, backend: AttentionBackend,
                   rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer layer_idx: forward(x, residual, meta, kv_cache) -> (x, residual), the residual add
        left to the next layer's first norm (families with another layer structure override this)."""
        return DecoderLayer(config, layer_idx, dtype, backend, rotary, self.make_mlp(config, layer_idx, dtype))

    def make_rotary(self, config, max_positions: int, layer_type: Optional[str]) -> RotaryEmbedding:
        """The rope table of one layer type (DeepSeek's covers only its rope dims, interleaved)."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return RotaryEmbedding(config, head_dim, max_positions, layer_type)

    def make_mlp(self, config, layer_idx: int, dtype: torch.dtype) -> nn.Module:
        """Layer layer_idx's feed-forward block (MoE families override this)."""
        return MLP(config, dtype)

    def make_norm(self, config, dtype: torch.dtype) -> nn.Module:
        """The final norm, forward(x, residual) -> (normed, x + residual)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input for input_ids (Gemma scales it)."""
        return self.embed_tokens(input_ids)

    # -- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor],
                intermediate: Optional[IntermediateTensors] = None):
        """The final-normed hidden states [T, H]; a stage before the last returns IntermediateTensors for the
        next, and a stage after the first takes them instead of input_ids. kv_caches: this stage's layers."""
        if self.embed_tokens is not None:
            stack = self._cpu_stack(kv_caches)
            if stack is not None:
                hidden = stack.run(input_ids, meta)
                if hidden is not None:
                    return hidden
            x, residual = self.embed(input_ids), None
        elif intermediate is None:
            raise ValueError(f"pipeline stage from layer {self.start_layer} needs the previous stage's "
                             "intermediate tensors")
        else:
            x, residual = intermediate.hidden, intermediate.residual
        return self.run_layers(x, residual, meta, kv_caches)

    def run_layers(self, x: torch.Tensor, residual: Optional[torch.Tensor], meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor]):
        """This stage's layers from the first one's input (x, residual), then the final norm (last stage)."""
        for layer, kv in zip(self.layers, kv_caches):
            if meta.interrupt is not None:
                meta.interrupt.check()  # a better-ranked arrival cuts a long step short (step/interrupt.py)
            x, residual = layer(x, residual, meta, kv)
        if self.norm is None:
            return IntermediateTensors(x, residual)
        x, _ = self.norm(x, residual)
        return x

    def _cpu_stack(self, kv_caches: list[torch.Tensor]) -> Optional[CpuStack]:
        """The one-call CPU stack for these caches (built on first use; None where it does not apply: it runs
        the whole model, so never on one pipeline stage of several)."""
        if not self.use_cpu_stack or self.lm_head is None:
            return None
        if self._stack_for is not kv_caches:
            self._stack_for, self._stack = kv_caches, CpuStack.build(self, kv_caches)
        return self._stack

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- weights ----------------------------------------------------------------------------
    # HF checkpoint name -> (our parameter prefix, shard index within a merged linear)
    _MERGED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def checkpoint_target(self, name: str) -> Optional[tuple[str, int]]:
        """(our parameter name, shard) for checkpoint tensor `name`, or None for a tensor this rank does not
        load (another pipeline stage's, a tied head's, rotary caches). Layer indices become this stage's."""
        name = name.removeprefix("model.")
        parts = name.split(".")
        if "rotary_emb" in parts or (name == "lm_head.weight" and self.tie_word_embeddings):
            return None
        if name == "embed_tokens.weight" and self.tie_word_embeddings and self.embed_tokens is None:
            return ("lm_head.weight", 0) if self.lm_head is not None else None  # the head is the embedding
        owners = {"embed_tokens": self.embed_tokens, "norm": self.norm, "lm_head": self.lm_head}
        if parts[0] in owners and owners[parts[0]] is None:
            return None
        if parts[0] == "layers":
            index = int(parts[1])
            if not self.start_layer <= index < self.end_layer:
                return None
            parts[1] = str(index - self.start_layer)
        shard = 0
        if len(parts) >= 2 and parts[-2] in self._MERGED:
            parts[-2], shard = self._MERGED[parts[-2]]
        return ".".join(parts), shard

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """weights: (checkpoint name, tensor or lazy checkpoint tensor): each module takes only its rank's slice
        (load_shard), so a lazy tensor is read no further than that; other stages' tensors are not read."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            found = self.checkpoint_target(name)
            if found is None:
                continue
            target, shard = found
            parts = target.split(".")
            if parts[-1] in ("k_scale", "v_scale") and parts[-2] == "self_attn":  # KV-cache scales
                self.get_submodule(".".join(parts[:-1])).load_kv_scale(0 if parts[-1] == "k_scale" else 1, tensor)
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            self._load_param(name, params[target], self.get_submodule(".".join(parts[:-1])), tensor, shard)
            loaded.add(target)
        return loaded

    @staticmethod
    def _load_param(name: str, param: nn.Parameter, module: nn.Module, tensor, shard: int) -> None:
        try:
            if hasattr(module, "load_shard"):
                module.load_shard(param, tensor, shard)
                return
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            param.data.copy_(materialize(tensor))
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None


MistralForCausalLM = Qwen2ForCausalLM = Qwen3ForCausalLM = LlamaForCausalLM
