"""BERT-family encoder (BertModel: all-MiniLM, BGE, E5, ... checkpoints) over the flat batch.

Same packed layout as the decoders (input_ids[T], positions[T], query_start_loc[B+1]; no padding to the
longest), post-norm residual blocks, bidirectional attention within each sequence
(layers/attention/bidirectional.py). An encoder keeps no KV cache: each prompt runs whole in one step
(config.PoolerConfig.whole_prompt), and the hidden states [T, H] go to the pooler (layers/pooler.py).
Single-sentence inputs only: token_type_ids are all 0, as sentence-transformers sends for one text.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.attention.base import paged_kv_shape
from tokenmill.layers.attention.bidirectional import bidirectional_attention
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, materialize
from tokenmill.layers.norm import LayerNorm

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class BertEmbeddings(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, h, dtype)
        self.position_embeddings = nn.Parameter(torch.zeros(config.max_position_embeddings, h, dtype=dtype),
                                                requires_grad=False)
        self.token_type_embeddings = nn.Parameter(torch.zeros(max(config.type_vocab_size, 1), h, dtype=dtype),
                                                  requires_grad=False)
        self.norm = LayerNorm(h, config.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings[positions] + self.token_type_embeddings[0]
        return self.norm(x)


class BertAttention(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=True, dtype=dtype,
                                          replicated=True)
        self.num_heads = self.num_kv_heads = heads
        self.o_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias=True, dtype=dtype,
                                        replicated=True)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The scheduler's block accounting only: an encoder keeps no KV (BertModel.uses_kv_cache)."""
        return paged_kv_shape(self.num_kv_heads, num_blocks, block_size, self.head_dim)

    def forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        o = bidirectional_attention(q, k, v, query_start_loc, self.scale)
        return self.o_proj(o.reshape(T, -1))


class BertLayer(nn.Module):
    def __init__(self, config, dtype: torch.dtype) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BertModel with hidden_act={act!r} is not supported; supported: "
                             f"{', '.join(sorted(_ACTIVATIONS))}")
        self.act = _ACTIVATIONS[act]
        self.self_attn = BertAttention(config, dtype)
        self.attn_norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.up_proj = ColumnParallelLinear(config.hidden_size, [config.intermediate_size], True, dtype,
                                            replicated=True)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, True, dtype,
                                           replicated=True)
        self.mlp_norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, x: torch.Tensor, query_start_loc: list[int]) -> torch.Tensor:
        x = self.attn_norm(self.self_attn(x, query_start_loc), x)
        return self.mlp_norm(self.down_proj(self.act(self.up_proj(x))), x)


class BertModel(nn.Module):
    """The encoder's last hidden states [T, H] for a flat batch of whole sequences."""
    uses_kv_cache = False  # the worker allocates no KV tensors; the scheduler's blocks are bookkeeping only

    def __init__(self, config, dtype: torch.dtype, backend=None, max_positions: int = 0,
                 layer_range: Optional[tuple[int, int]] = None) -> None:
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BertModel with position_embedding_type={position_type!r} is not supported "
                             "(absolute only)")
        self.config, self.dtype = config, dtype
        self.embeddings = BertEmbeddings(config, dtype)
        self.layers = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, meta, kv_caches=None, intermediate=None) -> torch.Tensor:
        if int(meta.positions.max()) >= self.embeddings.position_embeddings.shape[0]:
            raise ValueError(f"a sequence is longer than the model's {self.config.max_position_embeddings} "
                             "positions")
        x = self.embeddings(input_ids, meta.positions)
        for layer in self.layers:
            x = layer(x, meta.query_start_loc)
        return x

    # -- weights ----------------------------------------------------------------------------
    _RENAMES = {"attention.self.query": ("self_attn.qkv_proj", 0), "attention.self.key": ("self_attn.qkv_proj", 1),
                "attention.self.value": ("self_attn.qkv_proj", 2), "attention.output.dense": ("self_attn.o_proj", 0),
                "attention.output.LayerNorm": ("attn_norm", 0), "intermediate.dense": ("up_proj", 0),
                "output.dense": ("down_proj", 0), "output.LayerNorm": ("mlp_norm", 0)}

    def checkpoint_target(self, name: str) -> Optional[tuple[str, int]]:
        """(our parameter name, shard) for an HF BERT checkpoint tensor, None for one not used (the pooler head,
        position_ids buffers)."""
        name = name.removeprefix("bert.").removeprefix("model.")
        if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
            return None
        if name.startswith("embeddings."):
            rest = name.removeprefix("embeddings.")
            rest = {"position_embeddings.weight": "position_embeddings",
                    "token_type_embeddings.weight": "token_type_embeddings"}.get(rest, rest)
            return "embeddings." + rest.replace("LayerNorm.", "norm."), 0
        if name.startswith("encoder.layer."):
            index, rest = name.removeprefix("encoder.layer.").split(".", 1)
            module, leaf = rest.rsplit(".", 1)
            if module in self._RENAMES:
                ours, shard = self._RENAMES[module]
                return f"layers.{index}.{ours}.{leaf}", shard
        return name, 0

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            found = self.checkpoint_target(name)
            if found is None:
                continue
            target, shard = found
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in BertModel")
            module = self.get_submodule(target.rsplit(".", 1)[0]) if "." in target else self
            param = params[target]
            if hasattr(module, "load_shard"):
                module.load_shard(param, tensor, shard)
            elif tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r}: shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
            else:
                param.data.copy_(materialize(tensor))
            loaded.add(target)
        return loaded
