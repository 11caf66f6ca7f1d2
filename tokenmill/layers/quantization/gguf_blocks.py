"""A GGUF's weights in their own ggml block types (`--gguf-weights native`), as a quantization format.

The GGUF file is the checkpoint: each linear layer whose tensors are quantized keeps them as ggml.Parts, views
of the memory-mapped file (one per merged projection, each in its own type: a Q4_K_M file mixes Q4_K, Q6_K,
Q5_0 and Q8_0), and runs them through the block kernels (ggml.BlockLinear). A tensor-parallel rank views only
its rows, or its block-aligned columns. The token embedding (`BlockEmbedding`) dequantizes only the rows a
step looks up; a tied LM head runs the embedding's blocks like any linear. Float tensors (norms, and the rare
float linear weight) load as usual in the model dtype.

The loader hands these methods models.gguf.BlockTensor objects (anything with `part(rows, cols)`, `shape`
and `ggml_type`); a float tensor in a merged layer becomes an F32/F16/BF16 part.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from typing import Optional

import torch
from torch import nn

from tokenmill.distributed import tp_rank, tp_size
from tokenmill.layers.cpu_memory import page_out
from tokenmill.layers.embedding import vocab_block, vocab_parallel_lookup
from tokenmill.layers.fused_moe import FusedMoE
from tokenmill.layers.quantization import apply_quantization, ggml
from tokenmill.layers.quantization.base import QuantizationConfig, set_shard_loader, sharding_of

logger = logging.getLogger("tokenmill")

FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}  # ggml ids of the float types
EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def is_quantized(type_id: Optional[int]) -> bool:
    return type_id is not None and type_id not in FLOAT_TYPES.values()


def _part(loaded, rows: tuple[int, int], cols: tuple[int, int]) -> ggml.Part:
    """Rows and columns of a checkpoint tensor as a ggml.Part: blocks as they are, a float tensor as its
    float type's part (a copy of that slice)."""
    if hasattr(loaded, "part"):
        if loaded.splits_at(cols):
            return loaded.part(rows, cols)
        _log_once(f"the tensor-parallel split of the input dimension cuts {ggml.TYPE_NAMES[loaded.ggml_type]} "
                  f"blocks ({ggml.block_size(loaded.ggml_type)[0]} values): those shards run as float32 (slower)")
    t = loaded[rows[0]:rows[0] + rows[1], cols[0]:cols[0] + cols[1]]
    if t.dtype not in FLOAT_TYPES:
        t = t.float()
    t = t.contiguous()
    return ggml.Part(FLOAT_TYPES[t.dtype], t.view(torch.uint8).reshape(t.shape[0], -1))


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.warning("%s", message)


def _zero_rows(rows: int, K: int) -> ggml.Part:
    """Padding rows of a vocabulary shard (never among the logits kept)."""
    return ggml.Part(FLOAT_TYPES[torch.float32], torch.zeros(rows, 4 * K, dtype=torch.uint8))


def _bind(parts: list[ggml.Part], K: int, dtype: Optional[torch.dtype] = None) -> ggml.BlockLinear:
    """ggml.bind over views of the mapped file (dtype: measure the layer's row limit for x in it); the rows it
    repacked copies of leave the resident set as they are copied (their pages fault back in from the file should a
    lookup or a dequantized_weight read them)."""
    return ggml.bind(parts, K, dtype=dtype, release=page_out)


class BlockLinearMethod:
    """A linear layer over ggml parts. tied_to: a BlockEmbedding whose blocks are this layer's weight (a tied
    LM head); the layer then shares the embedding's placeholder parameter, as a float tied head shares its
    tensor."""

    def __init__(self, tied_to: Optional["BlockEmbedding"] = None) -> None:
        self.tied_to = tied_to
        self.parts: list[Optional[list[ggml.Part]]] = []
        self.dtype: Optional[torch.dtype] = None  # the activations' (the model's) dtype
        self.block_linear: Optional[ggml.BlockLinear] = None  # bound once the parts are loaded

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        self.parts, self.dtype = [None] * len(sharding_of(layer).local_sizes), dtype
        if self.tied_to is not None:
            layer.weight = self.tied_to.weight
            return
        # a placeholder, so the loader finds a parameter to hand this layer's tensors to
        placeholder = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.weight = set_shard_loader(placeholder, self._load)

    def _load(self, layer: nn.Module, param: nn.Parameter, loaded, shard: int) -> None:
        s = sharding_of(layer)
        expected = (s.full_sizes[shard], s.full_in)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not fit a layer expecting {expected}")
        start, rows = s.out_ranges[shard]
        parts = [_part(loaded, (start, rows), s.in_range)]
        if s.local_sizes[shard] > rows:
            parts.append(_zero_rows(s.local_sizes[shard] - rows, s.in_range[1]))
        self.parts[shard] = parts

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.tied_to is not None:
            self.parts = [self.tied_to.head_parts(layer.out_features)]
        if any(p is None for p in self.parts):
            raise ValueError("a GGUF linear layer is missing one of its merged projections")
        self.block_linear = _bind([p for parts in self.parts for p in parts], layer.in_features, self.dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return self.block_linear(x, bias, float_out=getattr(layer, "float_logits", False))

    def dequantized_weight(self, layer: nn.Module) -> torch.Tensor:
        """The float32 weight the parts stand for (tests, the quality report)."""
        return torch.cat([ggml.dequantize(p, layer.in_features) for parts in self.parts for p in parts])



class BlockEmbedding(nn.Module):
    """The vocabulary-parallel token embedding (layers/embedding.py) in a ggml block type: each rank views its
    block of rows of the file, and a lookup dequantizes only the rows it looks up."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size, self.dtype, self.tp = vocab_size, hidden_size, dtype, tp_size()
        self.start, self.rows, self.padded_rows = vocab_block(vocab_size, self.tp, tp_rank())
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)  # loader's handle
        self.part: Optional[ggml.Part] = None

    def load_shard(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        expected = (self.vocab_size, self.hidden_size)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not fit an embedding of {expected}")
        self.part = _part(loaded, (self.start, self.rows), (0, self.hidden_size))

    def head_parts(self, out_features: int) -> list[ggml.Part]:
        """The parts of a tied LM head over this rank's rows (padded to out_features)."""
        pad = out_features - self.rows
        return [self.part] + ([_zero_rows(pad, self.hidden_size)] if pad > 0 else [])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        def lookup(ids: torch.Tensor) -> torch.Tensor:
            rows = ggml.dequantize(self.part, self.hidden_size, ids.reshape(-1), self.dtype)
            return rows.reshape(*ids.shape, self.hidden_size)

        return vocab_parallel_lookup(input_ids, self.start, self.rows, self.tp, lookup)


class BlockMoEMethod:
    """MoE experts (layers/fused_moe.FusedMoE) over ggml parts: each expert's gate|up and down a BlockLinear
    over its rows of the file's stacked expert tensors (this rank's experts, or their slices)."""

    def __init__(self) -> None:
        self.parts: dict[tuple[int, str], ggml.Part] = {}
        self.w13: list[ggml.BlockLinear] = []
        self.w2: list[ggml.BlockLinear] = []

    def create_weights(self, layer: nn.Module, num_experts: int, hidden: int, intermediate: int,
                       dtype: torch.dtype) -> None:
        # placeholders: the loader counts the layer loaded once every expert's parts are in
        layer.w13_weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)

    def load_expert(self, layer: nn.Module, local: int, proj: str, weight, rows: tuple[int, int],
                    cols: tuple[int, int]) -> None:
        self.parts[(local, proj)] = _part(weight, rows, cols)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        H, n = layer.hidden_size, layer.intermediate_size
        experts = range(layer.num_local_experts)
        self.w13 = [_bind([self.parts[(e, "gate")], self.parts[(e, "up")]], H) for e in experts]
        self.w2 = [_bind([self.parts[(e, "down")]], n) for e in experts]

    def apply(self, layer: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        h = self.w13[expert](x, layer.expert_bias("w13", expert))
        return self.w2[expert](layer.act(h), layer.expert_bias("w2", expert))


class GgufConfig(QuantizationConfig):
    """Picks BlockLinearMethod for each linear layer whose checkpoint tensors include a quantized one.
    types: HF tensor name -> ggml type id (models.gguf.GgufWeights.types); layer_offset: the first decoder
    layer of this pipeline stage (our layer names count from it, the file's from 0)."""
    name = "gguf"
    online = False

    def __init__(self, types: dict[str, int], layer_offset: int = 0) -> None:
        self.types, self.layer_offset = dict(types), layer_offset
        if LM_HEAD not in self.types and EMBEDDING in self.types:  # tied: the head is the embedding's tensor
            self.types[LM_HEAD] = self.types[EMBEDDING]

    def _type(self, hf_name: str) -> Optional[int]:
        name = re.sub(r"\blayers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + self.layer_offset}.", hf_name)
        return self.types.get(f"{name}.weight")

    def get_linear_method(self, layer: nn.Module, prefix: str, hf_names: list[str]):
        return BlockLinearMethod() if any(is_quantized(self._type(n)) for n in hf_names) else None

    def describe(self) -> str:
        counts = Counter(ggml.TYPE_NAMES.get(t, str(t)) for t in self.types.values() if is_quantized(t))
        return "GGUF blocks (" + ", ".join(f"{n} x{c}" for n, c in counts.most_common()) + ")"


def install(model: nn.Module, types: dict[str, int]) -> tuple[GgufConfig, int]:
    """Before the GGUF's tensors load: block methods on the quantized linear layers, a BlockEmbedding for a
    quantized token embedding, and a tied head over its blocks. Returns the config and the layer count."""
    config = GgufConfig(types, getattr(model, "start_layer", 0))
    count = apply_quantization(model, config)
    count += _install_experts(model, types)
    embedding = getattr(model, "embed_tokens", None)
    if embedding is not None and is_quantized(types.get(EMBEDDING)):
        vocab, hidden = embedding.vocab_size, embedding.weight.shape[1]
        model.embed_tokens = BlockEmbedding(vocab, hidden, embedding.weight.dtype)
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(model, "tie_word_embeddings", False):
            head.quant_method = BlockLinearMethod(tied_to=model.embed_tokens)
            del head.weight
            head.quant_method.create_weights(head, head.in_features, head.out_features, embedding.weight.dtype)
            count += 1
    return config, count


def _install_experts(model: nn.Module, types: dict[str, int]) -> int:
    """BlockMoEMethod on every MoE layer when the file's experts are quantized; the count of those layers."""
    if not any(is_quantized(t) for name, t in types.items() if ".experts." in name):
        return 0
    moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for moe in moes:
        moe.quant_method = BlockMoEMethod()
        del moe.w13_weight, moe.w2_weight
        moe.quant_method.create_weights(moe, moe.num_local_experts, moe.hidden_size, moe.intermediate_size,
                                        moe.gate.weight.dtype)
    return len(moes)


def block_bytes(model: nn.Module) -> int:
    """Bytes of the model's ggml block weights (not parameters: views of the file), each tensor once."""
    parts = {}
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        held = getattr(method, "parts", None) or []
        held = list(held.values()) if isinstance(held, dict) else [q for ps in held for q in ps or []]
        for p in held + [getattr(m, "part", None)]:
            if isinstance(p, ggml.Part):
                parts[(p.data.data_ptr(), p.data.shape)] = p.data.numel()
    return sum(parts.values())
