"""Engine configuration: one dataclass per concern, built from kwargs or CLI flags.

All validation and the error messages users see for bad settings live here. Finding and reading the model a
setting names is not a setting: models/resolution.py does it, through the ModelResolver that
EngineConfig.finalize takes, so that this module stays a leaf every layer may import.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Optional, Protocol

from tokenmill.host import cuda_available, parse_size, usable_cpus

if TYPE_CHECKING:  # torch is imported where it is used: `tokenmill --help` must not wait seconds for it
    import torch

logger = logging.getLogger("tokenmill")

DTYPE_AUTO_RULE = ("on a CPU: bfloat16 for a GGUF served in its own block types (--gguf-weights native); "
                   "otherwise bfloat16 where the CPU has native bf16 dot products (AVX512_BF16 or AMX), else "
                   "float32, unless the other is at least 1.1x faster for the model's layer shapes in both the "
                   "best and the median of interleaved timing pairs, in each of two separate rounds")

QUANTIZATION_METHODS = ("int8", "w8a8", "fp8", "mxfp4", "nvfp4", "int4", "int4-g128")  # --quantization, float ckpt
# quantization_config.quant_method we load (mxfp4: gpt-oss's MoE experts)
CHECKPOINT_QUANTIZATION = ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")


def validate_quantization(requested: Optional[str], hf_config: Any, model_dir: str = "") -> Optional[str]:
    """The quantization that applies to a model: the checkpoint's own (config.json quantization_config) or
    an online method from --quantization. Raises on an unknown method or a contradiction."""
    req = None if requested in (None, "", "none") else str(requested).lower().replace("_", "-")
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    where = f" in {model_dir}" if model_dir else ""
    if qc:
        kind = str(qc.get("quant_method", "")).replace("_", "-")
        if kind not in CHECKPOINT_QUANTIZATION:
            raise ValueError(f"the checkpoint{where} is quantized with {kind or 'an unnamed method'!r}, which "
                             f"tokenmill cannot load (it loads {' and '.join(CHECKPOINT_QUANTIZATION)} checkpoints, "
                             f"or float checkpoints with --quantization {'|'.join(QUANTIZATION_METHODS)})")
        if req is not None and req != kind and not (req == "fp8" and kind == "compressed-tensors"):
            raise ValueError(f"the checkpoint{where} is already quantized ({kind}); --quantization {req} cannot "
                             "be applied on top of it: drop the flag to load it as it is")
        return kind
    if req is None:
        return None
    if req == "compressed-tensors":
        raise ValueError(f"--quantization compressed-tensors needs a compressed-tensors checkpoint; the model{where} "
                         f"is not quantized (quantize it on load with --quantization {'|'.join(QUANTIZATION_METHODS)})")
    if req not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {requested!r}; choose one of {', '.join(QUANTIZATION_METHODS)}")
    return req


ENCODER_ARCHITECTURES = ("BertModel",)
POOLING_METHODS = ("mean", "cls", "last")
TASKS = ("auto", "generate", "embed")


def layer_window(hf_config: Any, layer_idx: int) -> Optional[int]:
    """Decoder layer layer_idx's sliding window (None: full attention), read as transformers reads the config:
    `layer_types` where it is given (Gemma 3; Qwen2's max_window_layers), else `sliding_window` on every layer
    unless `use_sliding_window` is False (Qwen2). Takes a config object or its dict (tokenmill plan)."""
    if isinstance(hf_config, dict):
        get = hf_config.get
    else:
        def get(key: str, default: Any = None) -> Any:
            return getattr(hf_config, key, default)
    window, layer_types = get("sliding_window"), get("layer_types")
    if layer_types:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if get("use_sliding_window", True) is False:
        return None
    return window


def layer_windows(hf_config: Any) -> list[Optional[int]]:
    """Every decoder layer's window (layer_window)."""
    n = (hf_config.get("num_hidden_layers") if isinstance(hf_config, dict)
         else getattr(hf_config, "num_hidden_layers", None)) or 0
    return [layer_window(hf_config, i) for i in range(n)]


@dataclass
class PoolerConfig:
    """--task embed: a prompt's final hidden states -> one vector (vLLM's pooling runner). An encoder
    (bidirectional attention) and mean/CLS pooling need the whole prompt in one step; a decoder with last-token
    pooling may be prefilled in chunks like any prompt."""
    method: str = "last"           # mean | cls | last (token)
    normalize: bool = True         # L2-normalize the pooled vector
    encoder: bool = False          # bidirectional attention over the prompt (BertModel)
    max_seq_length: Optional[int] = None  # sentence_bert_config.json's limit, when the folder has one
    matryoshka_dimensions: Optional[list[int]] = None  # `dimensions` a request may ask for (None: refused)
    is_matryoshka: bool = False    # any `dimensions` up to the full size

    @property
    def whole_prompt(self) -> bool:
        return self.encoder or self.method != "last"


MM_PIXEL_KEYS = ("max_pixels", "min_pixels")
DEFAULT_IMAGES_PER_PROMPT = 16


def _json_flag(flag: str, value: Any, keys: tuple[str, ...]) -> dict:
    """A JSON-object flag (a string from the command line, or a dict) with only `keys` in it."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} must be a JSON object, e.g. {{\"{keys[0]}\": 4}}: {e}") from None
    if not isinstance(value, dict) or set(value) - set(keys):
        raise ValueError(f"{flag} takes a JSON object with the keys {', '.join(keys)}; got {value!r}")
    return dict(value)


@dataclass
class ModelConfig:
    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    served_model_name: Optional[str] = None
    quantization: Optional[str] = None  # online int8|w8a8|fp8|mxfp4|nvfp4; a quantized checkpoint's own method
    quantize_lm_head: bool = False      # online quantization covers the LM head too (default: model dtype)
    task: str = "auto"                  # generate | embed | auto (an encoder or sentence-transformers folder: embed)
    gguf_weights: str = "auto"          # a GGUF's weights: native (its own blocks) | dequantize (float) | auto
    # A vision-language model's images: at most this many per prompt ({"image": N}), and the image processor's
    # defaults (max_pixels / min_pixels: the quality/speed dial; a request's mm_processor_kwargs override them)
    limit_mm_per_prompt: Any = None
    mm_processor_kwargs: Any = None
    # Resolved in finalize():
    model_dir: str = ""
    hf_config: Any = None
    dtype_name: str = field(default="", init=False)  # the resolved dtype, a torch attribute name (torch_dtype)
    pooler: Optional["PoolerConfig"] = None  # task embed: how a prompt's hidden states become one vector
    # models/resolution_cache.py: the record's tokenizer class ("module:name") when finalize found one; the
    # key to write the record under when it did not (the tokenizer's loader writes it)
    tokenizer_class: Optional[str] = field(default=None, init=False)
    resolution_key: Optional[str] = field(default=None, init=False)

    @property
    def torch_dtype(self) -> Optional["torch.dtype"]:
        """The resolved dtype (imports torch: the API process reads dtype_name instead)."""
        if not self.dtype_name:
            return None
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def online_quantization(self) -> Optional[str]:
        """The --quantization method applied on load (None for a checkpoint that carries its own format)."""
        if self.quantization in QUANTIZATION_METHODS and not getattr(self.hf_config, "quantization_config", None):
            return self.quantization
        return None

    def __post_init__(self) -> None:
        self.limit_mm_per_prompt = _json_flag("--limit-mm-per-prompt", self.limit_mm_per_prompt, ("image",))
        self.mm_processor_kwargs = _json_flag("--mm-processor-kwargs", self.mm_processor_kwargs, MM_PIXEL_KEYS)
        for key, value in {**self.limit_mm_per_prompt, **self.mm_processor_kwargs}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{key} must be a non-negative integer, got {value!r}")

    @property
    def max_images_per_prompt(self) -> int:
        return self.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT)

    def finalize(self, device: str, resolver: ModelResolver) -> None:
        resolver.resolve_model(self, device)
        derived = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if self.pooler is not None and self.pooler.max_seq_length:  # sentence-transformers' own limit
            derived = min(derived, self.pooler.max_seq_length)
        if self.max_model_len is None:
            self.max_model_len = derived
        elif self.max_model_len > derived:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={derived}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


class ModelResolver(Protocol):
    """What finalizing the settings needs from above this leaf: finding, converting and reading the models
    (tokenmill.models.resolution.Resolver). resolve_model sets a ModelConfig's model_dir, tokenizer, hf_config,
    dtype_name, quantization, pooler, task and served_model_name; resolve_draft a SpeculativeConfig's
    draft_model_dir and draft_hf_config."""

    def resolve_model(self, model: ModelConfig, device: str) -> None: ...

    def resolve_draft(self, spec: "SpeculativeConfig") -> None: ...


@dataclass
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None  # CPU: bytes for KV; default 4 GiB
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: Optional[int] = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # auto (= model dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 | int8
    # KV tiers below the device pool (tokenmill/kv_transfer): evicted prefix-cache blocks go to host RAM, then
    # disk, and come back on a hit instead of being recomputed. Sizes in GiB (vLLM's unit) or "512MiB".
    kv_offloading_size: Optional[float] = None
    kv_offloading_disk_dir: Optional[str] = None
    kv_offloading_disk_size: float = 50.0
    # One KV group of every layer even where sliding-window layers could free the blocks that left their window
    # (step/kv_groups.py; vLLM's flag): the window then only masks, as before KV groups.
    disable_hybrid_kv_cache_manager: bool = False

    def validate(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be at least 1")
        if self.kv_cache_memory_bytes is not None:
            self.kv_cache_memory_bytes = parse_size(self.kv_cache_memory_bytes)
        self._validate_offloading()

    def _validate_offloading(self) -> None:
        if self.kv_offloading_size is not None:
            self.kv_offloading_size = parse_gib(self.kv_offloading_size, "kv_offloading_size")
        self.kv_offloading_disk_size = parse_gib(self.kv_offloading_disk_size, "kv_offloading_disk_size")
        if self.kv_offloading_disk_dir is not None and not self.kv_offloading_size:
            raise ValueError("--kv-offloading-disk-dir needs a host-RAM tier to stage blocks through: "
                             "set --kv-offloading-size (GiB) too")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size keeps evicted prefix-cache blocks; it needs prefix caching "
                             "(drop --no-enable-prefix-caching)")

    @property
    def kv_offloading_bytes(self) -> int:
        return int((self.kv_offloading_size or 0) * 2**30)

    @property
    def kv_offloading_disk_bytes(self) -> int:
        return int(self.kv_offloading_disk_size * 2**30) if self.kv_offloading_disk_dir else 0


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("TokenmillConnector",)


@dataclass
class KVTransferConfig:
    """--kv-transfer-config '{"kv_connector": "TokenmillConnector", "kv_role": ..., "kv_host": ..., "kv_port": ...}'
    (vLLM's flag and role names): disaggregated prefill/decode (tokenmill/kv_transfer/p2p_*.py). A producer
    serves its finished prompts' KV on kv_host:kv_port (0: any free port); a consumer pulls it; kv_both does
    either, as each request's kv_transfer_params say."""
    kv_connector: str = "TokenmillConnector"
    kv_role: str = "kv_both"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    hold_timeout_s: float = 60.0   # a producer frees the blocks of a prompt nobody pulled after this long
    pull_timeout_s: float = 30.0   # a consumer gives up a pull after this long (and recomputes the prompt)
    # {"allowed_peers": ["host:port", ...]}: the prefill instances (their KV address, as their params name it:
    # kv_host, or a wildcard bind's address on the default route, and kv_port) a consumer pulls from. The
    # address comes in each request's kv_transfer_params, so without the list a client could aim the pull at
    # any port the server reaches; a consumer without it pulls from nobody.
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, value: Any) -> Optional["KVTransferConfig"]:
        """From the flag's JSON text or a dict; ValueError with a one-line message when it is wrong."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--kv-transfer-config is not valid JSON ({e.msg} at character {e.pos}); "
                                 'expected e.g. \'{"kv_connector": "TokenmillConnector", "kv_role": "kv_both"}\'') \
                    from None
        if not isinstance(value, dict):
            raise ValueError("--kv-transfer-config must be a JSON object such as "
                             '\'{"kv_connector": "TokenmillConnector", "kv_role": "kv_producer"}\'')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown --kv-transfer-config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"--kv-transfer-config kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"--kv-transfer-config kv_port must be an integer port in 0..65535, got {self.kv_port!r}")
        if not isinstance(self.kv_host, str) or not self.kv_host:
            raise ValueError("--kv-transfer-config kv_host must be a host name or address")
        for name in ("hold_timeout_s", "pull_timeout_s"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"--kv-transfer-config {name} must be a positive number of seconds")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict) or set(extra) - {"allowed_peers"}:
            raise ValueError('--kv-transfer-config kv_connector_extra_config must be an object with the key '
                             '"allowed_peers" (a list of "host:port" strings)')
        peers = extra.get("allowed_peers", [])
        if not isinstance(peers, list):
            raise ValueError('--kv-transfer-config kv_connector_extra_config.allowed_peers must be a list of '
                             '"host:port" strings, e.g. ["10.0.0.1:14579"]')
        for peer in peers:
            parse_peer(peer)

    @property
    def allowed_peers(self) -> frozenset[tuple[str, int]]:
        """The (host, port) KV addresses this consumer may pull from (see kv_connector_extra_config)."""
        return frozenset(parse_peer(p) for p in self.kv_connector_extra_config.get("allowed_peers", []))

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def parse_peer(peer: Any) -> tuple[str, int]:
    """'10.0.0.1:14579' or '[::1]:14579' -> (host, port); ValueError with a one-line message."""
    host, _, port = peer.rpartition(":") if isinstance(peer, str) else ("", "", "")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--kv-transfer-config allowed_peers entries must be \"host:port\" with a port in "
                         f"1..65535, got {peer!r}")
    return host, int(port)


def peer_address(host: str, port: int) -> str:
    """parse_peer's inverse: 'host:port' ('[::1]:port' for an IPv6 address)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_gib(value: Any, name: str) -> float:
    """A size in GiB: a number (vLLM's unit for these flags) or a string with a unit ("512MiB")."""
    try:
        gib = float(value)
    except (TypeError, ValueError):
        gib = parse_size(value) / 2**30
    if gib < 0:
        raise ValueError(f"{name} must not be negative, got {value!r}")
    return gib


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    import torch

    return {"auto": model_dtype, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}[kv_cache_dtype]


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    scheduling_policy: str = "fcfs"  # fcfs, or priority (engine/request_queue.py)

    def validate(self, max_model_len: int) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown --scheduling-policy {self.scheduling_policy!r}; "
                             f"choose {' or '.join(SCHEDULING_POLICIES)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}")


@dataclass
class LoRAConfig:
    """--enable-lora: adapters (tokenmill/lora.py) served beside the base model. max_loras: adapters one step may
    run (the worker's slots); max_cpu_loras: adapters the worker keeps loaded in host memory (LRU, at least
    max_loras); max_lora_rank: the largest rank an adapter may have (every slot is that wide)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None

    @classmethod
    def parse(cls, kw: dict) -> Optional["LoRAConfig"]:
        """Pops the LoRA keys from engine kwargs; None unless enable_lora."""
        values = {k: kw.pop(k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras") if k in kw}
        if not kw.pop("enable_lora", False):
            return None
        config = cls(**{k: v for k, v in values.items() if v is not None})
        config.validate()
        return config

    def validate(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"--max-loras and --max-lora-rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({self.max_loras}): the adapters a step runs are kept in host memory too")


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3")


@dataclass
class SpeculativeConfig:
    """--speculative-config '{json}' (vLLM's keys). `adaptive` (ours) lets the engine lower k or pause
    speculation when the measured acceptance and step cost say it does not pay."""
    method: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    model: Optional[str] = None                 # draft model / EAGLE head directory
    prompt_lookup_min: Optional[int] = None     # ngram
    prompt_lookup_max: Optional[int] = None
    disable_by_batch_size: Optional[int] = None  # no speculation in steps with at least this many requests
    adaptive: bool = False
    quantization: Optional[str] = None          # draft_model: quantize the draft's weights on load
    eagle_aux_hidden_state_layer_ids: Optional[list[int]] = None  # eagle3: target layers whose input is fused
    # Resolved in finalize():
    draft_model_dir: str = ""
    draft_hf_config: Any = None

    @classmethod
    def parse(cls, value: Any) -> Optional["SpeculativeConfig"]:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls) if f.name not in ("draft_model_dir", "draft_hf_config")}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**value)

    @property
    def k(self) -> int:
        return self.num_speculative_tokens or 0

    @property
    def needs_kv(self) -> bool:
        """The drafter keeps its own paged KV (same block ids as the target)."""
        return self.method != "ngram"

    def finalize(self, model: ModelConfig, resolver: ModelResolver) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model else None
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
        if k > 16:
            raise ValueError(f"speculative_config num_speculative_tokens={k} is too large (at most 16)")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config disable_by_batch_size must be at least 1")
        if self.method == "ngram":
            if self.model:
                raise ValueError("speculative_config method 'ngram' takes no model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo = lo if lo is not None else min(hi, 2) if hi is not None else 2
            hi = hi if hi is not None else max(lo, 5)
            if not 1 <= lo <= hi:
                raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo} and {hi}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
            return
        if not self.model:
            raise ValueError(f"speculative_config method {self.method!r} needs \"model\": a local directory")
        resolver.resolve_draft(self)
        d, t = self.draft_hf_config, model.hf_config
        if self.method == "draft_model":
            if d.vocab_size != t.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({d.vocab_size}) differs from the target's "
                                 f"({t.vocab_size}); a draft model must share the tokenizer")
            if (getattr(d, "max_position_embeddings", None) or 2048) < model.max_model_len:
                raise ValueError(f"the draft model's max_position_embeddings ({d.max_position_embeddings}) is "
                                 f"below max_model_len={model.max_model_len}; lower --max-model-len")
        else:
            if d.hidden_size != t.hidden_size:
                raise ValueError(f"the EAGLE head's hidden_size ({d.hidden_size}) differs from the target's "
                                 f"({t.hidden_size}); the head was trained for another model")
        if self.quantization is not None and self.method != "draft_model":
            raise ValueError("speculative_config quantization applies to method 'draft_model' only")
        if self.method == "draft_model":
            self.quantization = validate_quantization(self.quantization, d, self.draft_model_dir)


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray", "uniproc")


@dataclass
class ParallelConfig:
    """How the model is split: tensor parallel x pipeline parallel ranks (expert parallel shards a MoE
    layer's experts over the tensor-parallel ranks). World size 1 is one process (uniproc)."""
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    distributed_executor_backend: Optional[str] = None  # mp | ray | uniproc; default mp when world size > 1
    pp_layer_partition: Optional[str] = None  # layers per pipeline stage, e.g. "16,14" (default: even split)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def finalize(self, device: str, hf_config: Any) -> None:
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        if tp < 1 or pp < 1:
            raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be at least 1, "
                             f"got {tp} and {pp}")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "mp" if self.world_size > 1 else "uniproc"
        backend = self.distributed_executor_backend
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"unknown --distributed-executor-backend {backend!r}; choose mp, ray or uniproc")
        if backend == "uniproc" and self.world_size > 1:
            raise ValueError(f"world size {self.world_size} (tensor x pipeline parallel) needs the mp or ray "
                             "executor, not uniproc")
        if backend == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'") \
                    from None
        elif self.world_size > 1:  # mp: every rank on this machine
            self._check_local_capacity(device)
        self._check_model_divides(hf_config)
        if self.pp_layer_partition is not None:
            self.layers_per_stage(hf_config.num_hidden_layers)  # validates

    def _check_local_capacity(self, device: str) -> None:
        if device == "cuda":
            import torch

            n = torch.cuda.device_count()
            if self.world_size > n:
                raise ValueError(f"world size {self.world_size} (tensor x pipeline parallel) is larger than the "
                                 f"{n} CUDA device(s) of this machine; use --distributed-executor-backend ray to "
                                 "span machines")
            return
        cores = usable_cpus()
        # Two ranks may share a core (a tiny model's TP=2 x PP=2 on 2 cores); more would time-slice every
        # collective to a crawl.
        if self.world_size > 2 * cores:
            raise ValueError(f"world size {self.world_size} (tensor x pipeline parallel) is larger than this "
                             f"machine can run: {cores} CPU core(s) take at most {2 * cores} ranks; use "
                             "--distributed-executor-backend ray to span machines")

    def _check_model_divides(self, cfg: Any) -> None:
        tp = self.tensor_parallel_size
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        ok = [n for n in range(1, heads + 1) if heads % n == 0 and (kv % n == 0 or n % kv == 0)]
        experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
        if self.enable_expert_parallel and not experts:
            logger.warning("--enable-expert-parallel has no effect: the model has no experts")
        width = getattr(cfg, "moe_intermediate_size", None) if experts else None
        width = width or getattr(cfg, "intermediate_size", 0)
        if tp > 1 and not (self.enable_expert_parallel and experts) and width % tp:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's MLP width {width}")
        if self.enable_expert_parallel and experts % tp:
            raise ValueError(f"--enable-expert-parallel over {tp} ranks: the model's {experts} experts do not "
                             f"divide; sizes that work: {', '.join(str(n) for n in range(1, experts + 1) if experts % n == 0)}")
        if tp not in ok and self.enable_expert_parallel and experts:
            logger.info("expert parallel over %d ranks: the %d attention heads do not divide, so attention is "
                        "replicated on every rank (the experts are still spread)", tp, heads)
        elif tp not in ok:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {heads} attention heads "
                             f"({kv} KV heads); sizes that work: {', '.join(map(str, ok))}")
        if self.pipeline_parallel_size > cfg.num_hidden_layers:
            raise ValueError(f"--pipeline-parallel-size {self.pipeline_parallel_size} is more than the model's "
                             f"{cfg.num_hidden_layers} layers")

    def layers_per_stage(self, num_layers: int) -> list[int]:
        pp = self.pipeline_parallel_size
        if self.pp_layer_partition is None:
            return [num_layers // pp + (1 if s < num_layers % pp else 0) for s in range(pp)]
        try:
            counts = [int(x) for x in self.pp_layer_partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"--pp-layer-partition {self.pp_layer_partition!r} must list {pp} positive layer "
                             f"counts that sum to the model's {num_layers} layers, e.g. "
                             f"{','.join(map(str, ParallelConfig(pipeline_parallel_size=pp).layers_per_stage(num_layers)))}")
        return counts


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: Optional[SpeculativeConfig] = None
    kv_transfer: Optional[KVTransferConfig] = None  # disaggregated prefill/decode (--kv-transfer-config)
    lora: Optional[LoRAConfig] = None  # --enable-lora
    device: str = "auto"
    log_step_stats: bool = False  # one log line per step: tokens, batch, time, MFU/MBU (tokenmill.plan)
    batch_invariant: bool = False  # a token's logits independent of its step's batch (layers/batch_invariant.py)
    step_records: bool = False  # per-step records (tokens, time, MFU/MBU) in EngineStats, for the dashboard

    def finalize(self, resolver: ModelResolver) -> "EngineConfig":
        """Every setting checked, the model found and read by resolver (models.resolution.resolve_engine_config
        passes its own)."""
        if self.device == "auto":
            self.device = "cuda" if cuda_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        self.cache.validate()
        self.model.finalize(self.device, resolver)
        self.scheduler.validate(self.model.max_model_len)
        self.parallel.finalize(self.device, self.model.hf_config)
        self._check_parallel_features()
        self._check_latent_kv()
        if self.batch_invariant and self.device != "cpu":
            raise ValueError("--batch-invariant runs on the CPU kernels only for now; use --device cpu")
        if self.speculative is not None:
            self._check_vlm_drafter()
            self.speculative.finalize(self.model, resolver)
        if self.model.pooler is not None:
            self._check_embed()
        if self.lora is not None:
            self._check_lora()
        return self

    def _check_vlm_drafter(self) -> None:
        """A draft model or EAGLE head would read a vision-language model's image placeholders as plain tokens,
        without the images' embeddings or M-RoPE positions: refused. N-gram proposals are checked by the model
        itself, so they stay exact."""
        if getattr(self.model.hf_config, "vision_config", None) is not None and self.speculative.method != "ngram":
            raise ValueError(f"a {self.speculative.method} drafter is not supported with a vision-language model "
                             "yet (it would not see the images); n-gram speculation works with it")

    def _check_lora(self) -> None:
        if self.model.pooler is not None:
            raise ValueError("--enable-lora applies to generation, not to --task embed")
        if self.batch_invariant:
            raise ValueError("--batch-invariant does not cover LoRA adapters yet (their matmuls run through torch); "
                             "drop one of the two")
        if self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(f"--enable-lora with a {self.speculative.method} drafter is not supported yet (the "
                             "drafter would not know the adapter); n-gram speculation works with it")

    def _check_embed(self) -> None:
        """--task embed: what pooling cannot combine with, and what an encoder's whole-prompt steps need."""
        pooler, sched = self.model.pooler, self.scheduler
        if self.speculative is not None or self.kv_transfer is not None or self.cache.kv_offloading_size:
            raise ValueError("--task embed runs prompts only: --speculative-config, --kv-transfer-config and "
                             "--kv-offloading-size do not apply to it")
        if pooler.encoder and self.parallel.world_size > 1:
            raise ValueError("encoder models (BertModel) run with a world size of 1 for now; drop "
                             "--tensor-parallel-size/--pipeline-parallel-size")
        if pooler.whole_prompt:  # one step per prompt: no chunks, and (bidirectional) no reusable prefix KV
            self.cache.enable_prefix_caching = False
            if sched.max_num_batched_tokens < self.model.max_model_len:
                raise ValueError(f"--task embed with {pooler.method} pooling runs each prompt in one step: "
                                 f"--max-num-batched-tokens ({sched.max_num_batched_tokens}) must be at least "
                                 f"--max-model-len ({self.model.max_model_len})")

    def _check_latent_kv(self) -> None:
        """A multi-head latent attention model (DeepSeek) caches one latent per token and layer, not K/V heads:
        what copies or quantizes K/V by head is refused at startup rather than run wrong."""
        if not getattr(self.model.hf_config, "kv_lora_rank", None):
            return
        refused = [what for what, on in (
            ("--kv-offloading-size (KV tiers)", bool(self.cache.kv_offloading_size)),
            ("--kv-transfer-config (disaggregated prefill/decode)", self.kv_transfer is not None),
            (f"--kv-cache-dtype {self.cache.kv_cache_dtype}", self.cache.kv_cache_dtype != "auto")) if on]
        if refused:
            raise ValueError(f"{refused[0]} is not supported for multi-head latent attention models (DeepSeek): "
                             "their KV cache holds a compressed latent per token, not K/V heads")

    def _check_parallel_features(self) -> None:
        """Features not built for a split model yet: refused by name rather than run wrong."""
        par = self.parallel
        if par.world_size == 1:
            return
        if self.kv_transfer is not None:
            raise ValueError("--kv-transfer-config (disaggregated prefill/decode) does not support tensor or "
                             "pipeline parallel yet; run each prefill and decode instance with a world size of 1")
        if self.cache.kv_offloading_size:
            raise ValueError("--kv-offloading-size (host-RAM/disk KV tiers) does not support tensor or pipeline "
                             "parallel yet; drop it or run with a world size of 1")
        spec = self.speculative
        if spec is not None and (par.pipeline_parallel_size > 1 or spec.method != "ngram"):
            raise ValueError(f"speculative decoding ({spec.method}) with "
                             f"{'pipeline' if par.pipeline_parallel_size > 1 else 'tensor'} parallel is not "
                             "supported yet" + ("; n-gram speculation works with tensor parallel"
                                                if par.pipeline_parallel_size == 1 else ""))

    @classmethod
    def from_kwargs(cls, **kw: Any) -> "EngineConfig":
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig}
        built = {}
        for name, klass in parts.items():
            names = {f.name for f in fields(klass) if f.init}
            built[name] = klass(**{k: kw.pop(k) for k in list(kw) if k in names})
        device = kw.pop("device", "auto")
        log_step_stats = bool(kw.pop("log_step_stats", False))
        batch_invariant = bool(kw.pop("batch_invariant", False))
        step_records = bool(kw.pop("step_records", False))
        built["speculative"] = SpeculativeConfig.parse(kw.pop("speculative_config", None))
        built["kv_transfer"] = KVTransferConfig.parse(kw.pop("kv_transfer_config", None))
        built["lora"] = LoRAConfig.parse(kw)
        if kw:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kw))}")
        return cls(device=device, log_step_stats=log_step_stats, batch_invariant=batch_invariant,
                   step_records=step_records, **built)

    # -- CLI -------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(p: argparse.ArgumentParser) -> None:
        for add in (_add_model_args, _add_cache_args, _add_quantization_args, _add_runtime_args, _add_lora_args):
            add(p)

    @classmethod
    def from_cli_args(cls, a: argparse.Namespace) -> "EngineConfig":
        return cls.from_kwargs(
            model=a.model_flag or a.model, tokenizer=a.tokenizer, dtype=a.dtype, max_model_len=a.max_model_len,
            seed=a.seed, served_model_name=a.served_model_name, block_size=a.block_size,
            kv_cache_memory_bytes=a.kv_cache_memory_bytes, gpu_memory_utilization=a.gpu_memory_utilization,
            num_gpu_blocks_override=a.num_gpu_blocks_override, enable_prefix_caching=a.enable_prefix_caching,
            kv_cache_dtype=a.kv_cache_dtype, quantization=getattr(a, "quantization", None),
            quantize_lm_head=getattr(a, "quantize_lm_head", False), task=getattr(a, "task", "auto"),
            gguf_weights=getattr(a, "gguf_weights", "auto"),
            limit_mm_per_prompt=getattr(a, "limit_mm_per_prompt", None),
            mm_processor_kwargs=getattr(a, "mm_processor_kwargs", None),
            kv_offloading_size=a.kv_offloading_size, kv_offloading_disk_dir=a.kv_offloading_disk_dir,
            kv_offloading_disk_size=a.kv_offloading_disk_size,
            disable_hybrid_kv_cache_manager=getattr(a, "disable_hybrid_kv_cache_manager", False),
            max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens, device=a.device,
            scheduling_policy=a.scheduling_policy,
            log_step_stats=getattr(a, "log_step_stats", False), batch_invariant=getattr(a, "batch_invariant", False),
            step_records=getattr(a, "no_dashboard", None) is False,  # serve's dashboard is on
            speculative_config=getattr(a, "speculative_config", None),
            kv_transfer_config=getattr(a, "kv_transfer_config", None),
            enable_lora=getattr(a, "enable_lora", False), max_loras=getattr(a, "max_loras", None),
            max_lora_rank=getattr(a, "max_lora_rank", None), max_cpu_loras=getattr(a, "max_cpu_loras", None),
            tensor_parallel_size=a.tensor_parallel_size, pipeline_parallel_size=a.pipeline_parallel_size,
            enable_expert_parallel=a.enable_expert_parallel,
            distributed_executor_backend=a.distributed_executor_backend, pp_layer_partition=a.pp_layer_partition)


ROUTER_POLICIES = ("prefix_aware", "least_load", "round_robin")


@dataclass
class RouterConfig:
    """`tokenmill router` (and the router in front of `tokenmill serve --data-parallel-size N`)."""
    replicas: list[str] = field(default_factory=list)  # base URLs of `tokenmill serve` instances
    policy: str = "prefix_aware"
    load_weight: float = 0.2            # prefix_aware: weight of the load excess over the least loaded replica
    prefix_chunk_chars: int = 64        # granularity of the router's prefix index
    health_check_interval: float = 1.0  # seconds between probes of each replica
    health_check_timeout: float = 5.0

    def validate(self, require_replicas: bool = True) -> "RouterConfig":
        """require_replicas False: the router launches its own (--launch) and may start with none."""
        if require_replicas and not self.replicas:
            raise ValueError("the router needs at least one --replica URL (e.g. http://127.0.0.1:8001)")
        for url in self.replicas:
            if not re.match(r"^https?://[^/\s]+/?$", url):
                raise ValueError(f"--replica {url!r} is not a base URL such as http://127.0.0.1:8001")
        if len({u.rstrip("/") for u in self.replicas}) != len(self.replicas):
            dup = next(u for u in self.replicas if [v.rstrip("/") for v in self.replicas].count(u.rstrip("/")) > 1)
            raise ValueError(f"{dup} is given twice (a URL is one instance: one --replica, or one --prefill or "
                             "--decode)")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}; choose one of {', '.join(ROUTER_POLICIES)}")
        if self.load_weight < 0:
            raise ValueError(f"load weight must be >= 0, got {self.load_weight}")
        if self.prefix_chunk_chars < 1:
            raise ValueError(f"prefix chunk size must be at least 1 character, got {self.prefix_chunk_chars}")
        if self.health_check_interval <= 0 or self.health_check_timeout <= 0:
            raise ValueError("health check interval and timeout must be positive")
        return self


def check_data_parallel_size(size: int) -> None:
    if size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {size}")


# -- the engine's flags (EngineConfig.add_cli_args), in --help order ----------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill serve` flags: the model: what to load and how to name it."""
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "half",
                                                        "float", "bf16", "fp32", "fp16"],
                   help="weight and activation dtype; auto follows the checkpoint's config; for a GGUF: "
                        f"bfloat16 on CUDA, and {DTYPE_AUTO_RULE}")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (prompt + output) in tokens (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--task", default="auto", choices=list(TASKS),
                   help="generate text, or embed (/v1/embeddings: pooled, normalized hidden states); auto = "
                        "embed for an encoder (BertModel) or a sentence-transformers folder, else generate")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's random state (sampling)")
    p.add_argument("--served-model-name", default=None,
                   help="model name the API reports and accepts (default: the model argument)")
    p.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help=f'a vision-language model\'s images per prompt, e.g. \'{{"image": 4}}\' '
                        f"(default {DEFAULT_IMAGES_PER_PROMPT})")
    p.add_argument("--mm-processor-kwargs", default=None, metavar="JSON",
                   help='image processor defaults, e.g. \'{"max_pixels": 401408}\': an image costs '
                        "pixels / 784 tokens at most, the quality/speed dial (requests may override it)")


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill serve` flags: the KV cache: blocks, memory, prefix caching, the offloading tiers."""
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (a power of two)")
    p.add_argument("--kv-cache-memory-bytes", default=None, help="KV cache size, e.g. 4GiB (CPU default 4GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of the GPU's memory for weights, activations and the KV cache")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="use exactly this many KV cache blocks instead of sizing the cache from memory")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of earlier prompts that share a prefix")
    p.add_argument("--kv-offloading-size", default=None,
                   help="GiB of host RAM (or e.g. 512MiB) for KV blocks evicted from the device cache; a later "
                        "prefix hit copies them back instead of recomputing")
    p.add_argument("--kv-offloading-disk-dir", default=None, metavar="PATH",
                   help="a disk tier below the host-RAM one: blocks the host tier evicts go to files "
                        "(checksummed) in a private folder under PATH, removed at exit")
    p.add_argument("--kv-offloading-disk-size", default=50.0, help="GiB of disk for that tier (default 50)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every block of sliding-window layers (one KV group of all layers; the window only "
                        "masks) instead of freeing the blocks that left the window")


def _add_quantization_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill serve` flags: weight quantization, GGUF weights, the KV cache dtype."""
    p.add_argument("--quantization", default=None, metavar="{" + ",".join(QUANTIZATION_METHODS) + "}",
                   help="quantize the linear weights on load (the LM head stays in the model dtype unless "
                        "--quantize-lm-head): int8 (weight-only, "
                        "per-channel), w8a8 (int8 weights and per-token int8 activations), fp8 (E4M3, "
                        "per-channel), mxfp4, nvfp4, int4 (weight-only, asymmetric, groups of 32; int4-g128: "
                        "groups of 128; both as ggml Q4_1 blocks). FP8 checkpoints (fp8, compressed-tensors) "
                        "and int4 ones (awq, gptq, compressed-tensors pack-quantized) load as they are "
                        "without the flag")
    p.add_argument("--gguf-weights", default="auto", choices=["auto", "native", "dequantize"],
                   help="a GGUF model's weights: native = served in the file's own block types, memory-mapped "
                        "(no float copy); dequantize = converted once to a float checkpoint (exact, for "
                        "comparisons with transformers; needs 4-8x the file in disk and memory); auto = "
                        "native for a quantized GGUF")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --quantization: quantize the LM head too (default: off, the head keeps the "
                        "model dtype, as in vLLM; faster decode, less accurate logits)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto = the model dtype; fp8/int8 store K and V quantized with "
                        "per-head scales (from the checkpoint's k_scale/v_scale, else 1.0 for fp8 and "
                        "calibrated on the first prefill for int8) and dequantize inside attention")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill serve` flags: scheduling, parallelism, device, speculation, KV transfer, diagnostics."""
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests running in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens (prefill chunks + decodes) in one step (default: 2048)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="fcfs = arrival order; priority = by the request's `priority` (lower first, ties by "
                        "arrival), preempting lower-priority running requests for a higher one")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each layer across this many ranks (query heads, MLP columns, vocabulary)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layers into this many consecutive stages, one rank group each")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: spread the experts over the tensor-parallel ranks instead of splitting "
                        "each expert")
    p.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray", "uniproc"],
                   help="where the ranks run: mp = processes on this machine (default when the world size "
                        "is above 1), ray = Ray actors, across machines")
    p.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                   help="layers per pipeline stage (default: an even split)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto = cuda when a CUDA device is visible, else cpu")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        '(methods: ngram, draft_model, eagle, eagle3)')
    p.add_argument("--kv-transfer-config", default=None,
                   help='disaggregated prefill/decode as JSON, e.g. \'{"kv_connector": "TokenmillConnector", '
                        '"kv_role": "kv_producer", "kv_host": "10.0.0.5", "kv_port": 14579}\' (roles: '
                        'kv_producer serves its prompts\' KV, kv_consumer pulls it, kv_both either); a '
                        'consumer pulls only from the producers it lists: "kv_connector_extra_config": '
                        '{"allowed_peers": ["10.0.0.5:14579"]}')
    p.add_argument("--batch-invariant", action="store_true",
                   help="make each token's logits bit-identical whatever else shares its step (batch size, "
                        "position, prefill chunking, prefix-cache hits); CPU")
    p.add_argument("--log-step-stats", action="store_true",
                   help="log each engine step: tokens, batch size, step time, MFU/MBU against the device's "
                        "figures (see `tokenmill plan`)")


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA adapters")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve PEFT LoRA adapters beside the base model (--lora-modules, /v1/load_lora_adapter)")
    g.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one step (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank served (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory, least recently used dropped (default --max-loras)")
