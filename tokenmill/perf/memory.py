"""Model shapes and the memory arithmetic: parameter counts, weight bytes, KV bytes, what fits.

A `ModelShape` is read from a Hugging Face `config.json` (dense Llama-family, Mixtral/Qwen-MoE experts,
DeepSeek MLA) or taken from a built-in preset of well-known models, which are written as the same
config dicts so both paths go through one parser.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from tokenmill.config import layer_windows
from tokenmill.perf.gguf_bytes import GgufBytes

# Bytes per element. fp4 ignores its per-group scales (a few percent); int4 is stored as ggml Q4_1 blocks (an
# fp16 scale and min per 32 values: 5 bits). "gguf" is a GGUF file served in its own blocks: each tensor's real
# bytes, which only the model knows (ModelShape.gguf, perf/gguf_bytes.py); "gguf:<bits per weight>" is any model
# at that average (what-if: e.g. a preset as a Q4_K_M download, gguf:4.85).
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.625, "fp4": 0.5}
GGUF = "gguf"
GGUF_DTYPE = "gguf:"
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
                  "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "e4m3": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}


def normalize_dtype(name: str) -> str:
    key = _DTYPE_ALIASES.get(str(name).lower().removeprefix("torch."), str(name).lower().removeprefix("torch."))
    if key == GGUF:
        return key
    if key.startswith(GGUF_DTYPE):
        try:
            if 0 < float(key[len(GGUF_DTYPE):]) <= 32:
                return key
        except ValueError:
            pass
        raise ValueError(f"{name!r}: a GGUF weight dtype is gguf:<bits per weight>, e.g. gguf:4.85")
    if key not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_BYTES)}, gguf or gguf:<bits>")
    return key


def dtype_bytes(name: str) -> float:
    key = normalize_dtype(name)
    if key == GGUF:
        raise ValueError("weight dtype gguf is a GGUF file's own blocks: their bytes come from the model "
                         "(ModelShape.weight_bytes); give a .gguf model, or gguf:<bits per weight>")
    return float(key[len(GGUF_DTYPE):]) / 8 if key.startswith(GGUF_DTYPE) else DTYPE_BYTES[key]


def kv_groups(windows: Sequence[Optional[int]]) -> tuple[int, list[tuple[Optional[int], tuple[int, ...]]]]:
    """How the engine's KV cache groups layers of these per-layer windows (None: full attention), as
    (layer slots per group, [(window, layer indices)] per group): one group when every layer is of one kind;
    else every kind split into groups of as many layers as the smallest kind has (the last one padded), full
    attention first (step/kv_groups.py holds the layout built on this)."""
    kinds: dict[Optional[int], list[int]] = {}
    for i, w in enumerate(windows):
        kinds.setdefault(w, []).append(i)
    if len(kinds) <= 1:
        return len(windows), [(next(iter(kinds), None), tuple(range(len(windows))))]
    slots = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return slots, [(w, tuple(kinds[w][i:i + slots])) for w in order for i in range(0, len(kinds[w]), slots)]


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int          # dense MLP width (0 when every layer is MoE)
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False           # Qwen3: RMSNorm over q and k heads
    qkv_bias: bool = False          # Qwen2
    o_bias: bool = False            # attention_bias on the output projection too (gpt-oss)
    attn_sinks: bool = False        # a learned sink logit per head and layer (gpt-oss)
    expert_bias: bool = False       # router and expert biases (gpt-oss)
    norms_per_layer: int = 2        # RMSNorms of hidden_size per layer (Gemma 3: four)
    # Mixture of experts: `num_dense_layers` layers keep a dense MLP, the rest route to experts.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    num_dense_layers: int = 0
    router_bias: bool = False       # DeepSeek-V3's e_score_correction_bias: one float per expert and MoE layer
    # Multi-head latent attention (DeepSeek): the cache holds one compressed vector per token and layer.
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # A GGUF file's tensors in their own types: the bytes behind weight dtype "gguf" (None for other models).
    gguf: Optional[GgufBytes] = None
    # Each layer's sliding window (None: full attention); empty when no layer has one.
    windows: tuple[Optional[int], ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    # -- parameters ---------------------------------------------------------------------------
    def attention_params(self) -> int:
        h, nh = self.hidden_size, self.num_heads
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * nh * qk
            else:
                q = h * nh * qk
            kv = (h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * nh * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + nh * self.v_head_dim * h
        d, kvh = self.head_dim, self.num_kv_heads
        params = h * nh * d + 2 * h * kvh * d + nh * d * h
        if self.qkv_bias:
            params += nh * d + 2 * kvh * d
        if self.qk_norm:
            params += 2 * d
        return params + (h if self.o_bias else 0) + (nh if self.attn_sinks else 0)

    def expert_params(self) -> int:
        h, i = self.hidden_size, self.moe_intermediate_size
        return 3 * h * i + (2 * i + h if self.expert_bias else 0)  # gate, up, down (+ their biases)

    def shared_expert_params(self) -> int:
        width = self.shared_expert_intermediate_size or self.num_shared_experts * self.moe_intermediate_size
        return 3 * self.hidden_size * width

    def router_params(self) -> int:
        return (self.hidden_size + bool(self.expert_bias) + bool(self.router_bias)) * self.num_experts

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _fixed_params(self) -> int:
        """Everything but the routed experts: counted whole for every token."""
        h = self.hidden_size
        per_layer = self.attention_params() + self.norms_per_layer * h  # + e.g. input and post-attention norms
        total = self.num_layers * per_layer + h       # + final norm
        total += self.num_dense_layers * 3 * h * self.intermediate_size if self.is_moe else \
            self.num_layers * 3 * h * self.intermediate_size
        if self.is_moe:
            total += self.num_moe_layers * (self.router_params() + self.shared_expert_params())
        total += self.embedding_params() * (1 if self.tie_word_embeddings else 2)
        return total

    @property
    def params_total(self) -> int:
        return self._fixed_params() + self.num_moe_layers * self.num_experts * self.expert_params()

    @property
    def params_active(self) -> int:
        """Parameters one token touches (the embedding table counted whole, as model cards do)."""
        return self._fixed_params() + self.num_moe_layers * self.experts_per_token * self.expert_params()

    def distinct_experts(self, tokens: float) -> float:
        """Experts one MoE layer touches in a step over `tokens` tokens, with uniform routing: E(1 - (1 - k/E)^t)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** max(tokens, 1.0))

    def params_touched(self, tokens: float) -> float:
        """Parameters a step over `tokens` tokens reads (the distinct experts of each MoE layer)."""
        if not self.is_moe:
            return float(self.params_total)
        return self._fixed_params() + self.num_moe_layers * self.distinct_experts(tokens) * self.expert_params()

    # -- weight bytes --------------------------------------------------------------------------
    def _gguf_for(self, weight_dtype: str) -> Optional[GgufBytes]:
        if normalize_dtype(weight_dtype) != GGUF:
            return None
        if self.gguf is None:
            raise ValueError(f"weight dtype gguf (a GGUF file's own blocks) needs a .gguf model; {self.name} is "
                             "not one: give gguf:<bits per weight> for a what-if")
        return self.gguf

    def weight_bytes(self, weight_dtype: str) -> int:
        """All the weights in memory: a GGUF's own tensor bytes, else params x the dtype's bytes."""
        g = self._gguf_for(weight_dtype)
        return g.total if g else int(self.params_total * dtype_bytes(weight_dtype))

    def bytes_per_param(self, weight_dtype: str) -> float:
        """Average bytes per parameter: what a split (TP ranks, PP stages) holds of each parameter it gets. A
        GGUF's blocks are spread evenly over its parameters (the types differ a little by tensor)."""
        g = self._gguf_for(weight_dtype)
        return g.total / self.params_total if g else dtype_bytes(weight_dtype)

    def weight_bytes_read(self, tokens: float, weight_dtype: str) -> float:
        """Weight bytes a step over `tokens` tokens reads. A GGUF served natively reads every tensor once, but
        of an untied token embedding only the looked-up rows (a tied LM head reads the embedding's blocks in
        full), and of the routed experts the distinct ones; other dtypes count params_touched (as before)."""
        g = self._gguf_for(weight_dtype)
        if g is None:
            return self.params_touched(tokens) * dtype_bytes(weight_dtype)
        nbytes = float(g.total)
        if not self.tie_word_embeddings:
            nbytes -= g.embedding - min(max(tokens, 1.0), g.embedding_rows) * g.embedding_row
        if self.is_moe:
            nbytes -= g.experts * (1.0 - self.distinct_experts(tokens) / self.num_experts)
        return nbytes

    @property
    def matmul_params_active(self) -> int:
        """Weights in a token's matmuls: active params less the input embedding (a lookup, no FLOPs;
        with tied embeddings the same matrix is the LM head, which is a matmul)."""
        return self.params_active - (0 if self.tie_word_embeddings else self.embedding_params())

    def attention_flops_per_pair(self, absorbed: bool = False) -> int:
        """FLOPs for one (query token, cached token) pair over all layers: QK^T and PV. MLA decode kernels
        (`absorbed`) attend in the latent space: keys of kv_lora_rank + rope dims, values of kv_lora_rank."""
        if self.is_mla and absorbed:
            qk, v = self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank
        elif self.is_mla:
            qk, v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            qk = v = self.head_dim
        return self.num_layers * 2 * self.num_heads * (qk + v)

    # -- KV cache ----------------------------------------------------------------------------
    def kv_bytes_per_token(self, kv_dtype: str = "bf16") -> int:
        """One token's K/V in every layer (what a token costs while every layer keeps it)."""
        b = dtype_bytes(kv_dtype)
        if self.is_mla:  # one latent (kv_lora_rank) plus the shared rope key per layer, not per head
            return int(self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * b)
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * b)

    @property
    def kv_groups(self) -> tuple[int, list[tuple[Optional[int], tuple[int, ...]]]]:
        """The engine's KV groups for this model (kv_groups above)."""
        return kv_groups(self.windows or (None,) * self.num_layers)

    def kv_bytes_per_block_token(self, kv_dtype: str = "bf16") -> float:
        """Bytes per token of one KV block as the engine allocates it: its layer slots' K/V (all layers when the
        model has one kind of layer)."""
        return self.kv_bytes_per_token(kv_dtype) * self.kv_groups[0] / self.num_layers

    def kv_slots_of(self, layers: range) -> int:
        """Layer slots the engine allocates for these layers (a pipeline stage's): the slots their KV groups use,
        one per layer when the model has one kind of layer."""
        slot = {layer: i for _, group in self.kv_groups[1] for i, layer in enumerate(group)}
        return len({slot[layer] for layer in layers})

    def kv_block_tokens_per_seq(self, context_len: int) -> int:
        """Block-tokens one sequence of context_len tokens holds over the KV groups: a full group every token, a
        sliding one at most its window."""
        return sum(context_len if w is None else min(context_len, w) for w, _ in self.kv_groups[1])

    def kv_bytes_per_seq(self, kv_dtype: str, context_len: int) -> int:
        """KV bytes of one sequence of context_len tokens: full layers x context + sliding layers x min(context,
        window), the sliding layers counted in whole groups as the engine allocates them (Gemma-3-27B: 52 local
        layers in 6 groups of 10 slots)."""
        return int(self.kv_bytes_per_block_token(kv_dtype) * self.kv_block_tokens_per_seq(context_len))

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, name: Optional[str] = None) -> "ModelShape":
        if not isinstance(cfg, dict):
            cfg = cfg.to_dict()
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = {**cfg["text_config"], "_name_or_path": cfg.get("_name_or_path")}
        try:
            h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
            vocab = cfg["vocab_size"]
        except KeyError as e:
            raise ValueError(f"config lacks {e.args[0]!r}; tokenmill plan reads decoder-only transformer configs "
                             "(Llama, Mistral, Qwen, Mixtral, DeepSeek, Gemma 3, gpt-oss)") from None
        mtype = cfg.get("model_type", "")
        windows = tuple(layer_windows(cfg))
        kw: dict[str, Any] = dict(windows=windows if any(w is not None for w in windows) else (),
            name=name or cfg.get("_name_or_path") or mtype or "model", hidden_size=h, num_layers=layers,
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or h // heads, intermediate_size=cfg.get("intermediate_size") or 0,
            vocab_size=vocab, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=mtype in ("qwen3", "qwen3_moe", "gemma3_text"), qkv_bias=mtype in ("qwen2", "qwen2_moe") or
            bool(cfg.get("attention_bias", False)), norms_per_layer=4 if mtype == "gemma3_text" else 2,
            o_bias=bool(cfg.get("attention_bias", False)) and mtype != "qwen2",
            attn_sinks=mtype == "gpt_oss", expert_bias=mtype == "gpt_oss")
        experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # transformers 5 renamed Qwen's
        if cfg.get("n_routed_experts"):  # DeepSeek V2/V3
            freq = cfg.get("moe_layer_freq", 1) or 1
            first = cfg.get("first_k_dense_replace", 0)
            moe_layers = sum(1 for i in range(layers) if i >= first and i % freq == 0)
            kw.update(num_experts=cfg["n_routed_experts"], experts_per_token=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg["moe_intermediate_size"],
                      num_shared_experts=cfg.get("n_shared_experts") or 0, num_dense_layers=layers - moe_layers,
                      router_bias=mtype == "deepseek_v3")
        elif experts and cfg.get("moe_intermediate_size"):  # Qwen2/Qwen3 MoE
            step = cfg.get("decoder_sparse_step", 1) or 1
            dense_only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
            kw.update(num_experts=experts, experts_per_token=cfg["num_experts_per_tok"],
                      moe_intermediate_size=cfg["moe_intermediate_size"], num_dense_layers=layers - moe_layers,
                      shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size") or 0)
        elif experts:  # Mixtral, gpt-oss: every layer's MLP is `experts` copies of intermediate_size
            kw.update(num_experts=experts, experts_per_token=cfg.get("num_experts_per_tok", 2),
                      moe_intermediate_size=cfg["intermediate_size"], intermediate_size=0)
        if cfg.get("kv_lora_rank"):
            kw.update(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=cfg["kv_lora_rank"],
                      qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                      v_head_dim=cfg["v_head_dim"], num_kv_heads=heads)
        return cls(**kw)


def _llama(h, layers, heads, kv, inter, vocab=128256, tie=False, **extra) -> dict:
    return dict(model_type="llama", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tie, **extra)


def _qwen3(h, layers, heads, kv, inter, tie=False, **extra) -> dict:
    return dict(model_type="qwen3", hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, head_dim=128, intermediate_size=inter, vocab_size=151936,
                tie_word_embeddings=tie, **extra)


# Shapes from the models' published config.json files.
PRESETS: dict[str, dict] = {
    "Llama-3.1-8B": _llama(4096, 32, 32, 8, 14336),
    "Llama-3.1-70B": _llama(8192, 80, 64, 8, 28672),
    "Llama-3.1-405B": _llama(16384, 126, 128, 8, 53248),
    "Qwen3-0.6B": _qwen3(1024, 28, 16, 8, 3072, tie=True),
    "Qwen3-8B": _qwen3(4096, 36, 32, 8, 12288),
    "Qwen3-32B": _qwen3(5120, 64, 64, 8, 25600),
    "Qwen3-235B-A22B": {**_qwen3(4096, 94, 64, 4, 12288), "model_type": "qwen3_moe", "num_experts": 128,
                        "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "decoder_sparse_step": 1,
                        "mlp_only_layers": []},
    "Mixtral-8x7B": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),
    "DeepSeek-V3": dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, intermediate_size=18432, moe_intermediate_size=2048,
                        vocab_size=129280, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        first_k_dense_replace=3, moe_layer_freq=1, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc",
                        tie_word_embeddings=False),
    "SmolLM2-135M": _llama(576, 30, 9, 3, 1536, vocab=49152, tie=True),
    # Five sliding-window (1024) layers to one global: a sequence's KV counts the local layers' only up to the
    # window (kv_bytes_per_seq), as the engine's KV groups free the rest.
    "Gemma-3-27B": dict(model_type="gemma3_text", hidden_size=5376, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, intermediate_size=21504, vocab_size=262208,
                        tie_word_embeddings=True, sliding_window=1024, query_pre_attn_scalar=168,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(62)]),
    # Sliding-window (128) and full layers alternating: half the layers keep at most 128 tokens of KV. Its
    # experts ship as MXFP4 (the rest bf16); `--weight-dtype fp4` prices every weight at that.
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088,
                         num_local_experts=128, num_experts_per_tok=4, attention_bias=True,
                         tie_word_embeddings=False, sliding_window=128,
                         layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)]),
}
PRESET_ALIASES = {"smollm2-135m-instruct": "SmolLM2-135M", "llama-3.1-8b-instruct": "Llama-3.1-8B",
                   "llama-3.1-70b-instruct": "Llama-3.1-70B", "llama-3.1-405b-instruct": "Llama-3.1-405B",
                   "mixtral-8x7b-instruct": "Mixtral-8x7B", "mixtral-8x7b-instruct-v0.1": "Mixtral-8x7B",
                   "mixtral-8x7b-v0.1": "Mixtral-8x7B", "deepseek-v3-0324": "DeepSeek-V3", "deepseek-r1": "DeepSeek-V3",
                   "gemma-3-27b-it": "Gemma-3-27B", "gemma-3-27b-pt": "Gemma-3-27B", "gpt-oss": "gpt-oss-120b"}


@dataclass
class MemoryPlan:
    weight_bytes: int
    kv_bytes_per_token: int         # averaged over the context (sliding-window layers keep only their window)
    kv_bytes_per_seq: int
    memory_bytes: int               # all GPUs together
    usable_bytes: int               # x memory_utilization
    max_concurrent_seqs: int
    min_gpus: int


def memory_plan(shape: ModelShape, weight_dtype: str, kv_dtype: str, context_len: int, gpu_memory_bytes: int,
                num_gpus: int = 1, memory_utilization: float = 0.9) -> MemoryPlan:
    """What fits: KV gets whatever the weights leave of `memory_utilization` of all GPUs' memory.
    min_gpus: the fewest GPUs whose memory is at least 1.5x the weights (KV headroom of half the weights)."""
    weight = shape.weight_bytes(weight_dtype)
    kv_seq = shape.kv_bytes_per_seq(kv_dtype, context_len)
    kv_tok = kv_seq // max(context_len, 1)  # averaged over the context (sliding layers keep only their window)
    total = gpu_memory_bytes * num_gpus
    usable = int(total * memory_utilization)
    max_seqs = max(0, (usable - weight) // kv_seq) if kv_seq else 0
    min_gpus = max(1, math.ceil(1.5 * weight / gpu_memory_bytes))
    return MemoryPlan(weight, kv_tok, kv_seq, total, usable, int(max_seqs), min_gpus)
