"""Model resolution: from what a user named (a folder, a .gguf file, a Hub-looking id, nothing) to a model
the engine can build: its folder, its config, its dtype, its pooler, and a draft model's the same way.

config.py holds the settings and their checks and leaves finding and reading models to this module
(EngineConfig.finalize takes a ModelResolver): the settings are a leaf that every layer reads, while
resolving a model needs the GGUF converter, the weight-format rules and, for --dtype auto on a CPU, the
matmul kernels' timings.
"""
from __future__ import annotations

import json
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Optional

from tokenmill.config import (ENCODER_ARCHITECTURES, POOLING_METHODS, TASKS, EngineConfig, ModelConfig, PoolerConfig,
                              SpeculativeConfig, validate_quantization)
from tokenmill.host import cpu_has_native_bf16
from tokenmill.models import default_model, resolution_cache
from tokenmill.startup import Ledger, timed

if TYPE_CHECKING:  # torch is imported where it is used: a warm start's API process never imports it
    import torch

logger = logging.getLogger("tokenmill")


def resolve_engine_config(config: EngineConfig, install_default: bool = False,
                          ledger: Optional[Ledger] = None) -> EngineConfig:
    """config, finalized: the device picked, the model (and draft) found and read, every setting checked.
    ledger gets the phases "model resolution" (GGUF conversion included) and "dtype selection"."""
    return config.finalize(Resolver(install_default, ledger))


class Resolver:
    """config.ModelResolver: a warm start takes the config and dtype from the last start's record
    (models/resolution_cache.py) and imports neither transformers nor torch."""

    def __init__(self, install_default: bool = False, ledger: Optional[Ledger] = None):
        self.install_default = install_default
        self.ledger = ledger

    def resolve_model(self, mc: ModelConfig, device: str) -> None:
        with timed(self.ledger, "model resolution"):
            mc.model_dir = resolve_model_path(mc.model, self.install_default,
                                              gguf_weights_for(mc.gguf_weights, mc.quantization))
            if mc.tokenizer is None:
                mc.tokenizer = mc.model_dir
            key = resolution_cache.key(mc.model_dir, mc.tokenizer, mc.dtype, device)
            record = resolution_cache.load(key)
            if record is not None:
                mc.hf_config, mc.dtype_name, mc.tokenizer_class = (record.hf_config, record.dtype,
                                                                   record.tokenizer_class)
            else:
                from tokenmill.models import gguf  # numpy: a cold start imports it with transformers anyway

                mc.hf_config, mc.resolution_key = read_hf_config(mc.model_dir), key
                mc.tokenizer_class = gguf.tokenizer_class(mc.tokenizer)
        cfg = mc.hf_config
        mc.quantization = validate_quantization(mc.quantization, cfg, mc.model_dir)
        if record is None:
            cfg_dtype = cfg.dtype if hasattr(cfg, "dtype") else getattr(cfg, "torch_dtype", None)
            with timed(self.ledger, "dtype selection"):
                mc.dtype_name = str(resolve_dtype(mc.dtype, cfg_dtype, device, cfg)).removeprefix("torch.")
        mc.pooler = resolve_pooler(mc.task, mc.model_dir, cfg)
        mc.task = "embed" if mc.pooler is not None else "generate"
        if mc.served_model_name is None:
            mc.served_model_name = mc.model or default_model.DEFAULT_MODEL_NAME

    def resolve_draft(self, spec: SpeculativeConfig) -> None:
        spec.draft_model_dir = resolve_model_path(spec.model,
                                                  gguf_weights=gguf_weights_for("auto", spec.quantization))
        try:
            spec.draft_hf_config = read_hf_config(spec.draft_model_dir)
        except ValueError:
            if spec.method == "draft_model":
                raise
            from transformers import LlamaConfig  # EAGLE heads often carry a custom architecture name

            with open(os.path.join(spec.draft_model_dir, "config.json")) as f:
                spec.draft_hf_config = LlamaConfig(**json.load(f))


def read_hf_config(model_dir: str) -> Any:
    from transformers import AutoConfig  # with torch: most of a cold start's resolution time

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - surface a one-line reason
        raise ValueError(f"cannot read {os.path.join(model_dir, 'config.json')}: {e}") from None
    return text_view(config)


_VLM_FIELDS = ("architectures", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id", "tie_word_embeddings")


def text_view(config: Any) -> Any:
    """A vision-language model's config as every reader of hf_config expects one (layers, heads, vocabulary at
    the top): its text decoder's config, with the vision config and image token ids beside them."""
    if getattr(config, "vision_config", None) is None or getattr(config, "text_config", None) is None:
        return config
    text = config.text_config
    extras = {name: getattr(config, name) for name in _VLM_FIELDS if getattr(config, name, None) is not None}
    return type(text)(**{**text.to_dict(), **extras})


# -- the model's folder ------------------------------------------------------------------------------------
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as the Hugging Face Hub spells repos
MODEL_FORMS = "a local Hugging Face folder (config.json, *.safetensors, tokenizer files) or a llama.cpp .gguf file"


def model_not_found_message(model: str) -> str:
    """What to tell a user whose model argument names nothing on this machine: that the path does not exist,
    or, for what looks like a Hub id, that nothing is downloaded at run time and how to bring the model here."""
    if _HUB_ID_RE.match(model) and not model.endswith(".gguf"):
        folder = "./" + model.rsplit("/", 1)[-1]
        return (f"model {model!r} is not a local path; it looks like a Hugging Face Hub id, but nothing is "
                f"downloaded at run time. Get the model onto this machine first: on a connected machine run "
                f"`huggingface-cli download {model} --local-dir {folder}`, copy that folder here and pass its "
                f"path, or pass any llama.cpp GGUF file")
    return f"model {model!r} does not exist: pass {MODEL_FORMS}; nothing is downloaded at run time"


def gguf_weights_for(requested: str, quantization: Optional[str]) -> str:
    """--gguf-weights with --quantization in view: auto means dequantize when asked to quantize on load (the
    online methods start from float weights), else native for a quantized GGUF (models/gguf.py)."""
    if requested == "auto" and quantization not in (None, "", "none"):
        return "dequantize"
    return requested


def resolve_model_path(model: Optional[str], install_default: bool = False, gguf_weights: str = "auto") -> str:
    """A local HF directory, a .gguf file, or None for the built-in default model.
    Returns a Hugging Face directory (a GGUF file's is made once and cached: models/gguf.py; gguf_weights is
    --gguf-weights)."""
    if model is None or model == "default":
        model = default_model.default_model_path(install=install_default)
    if os.path.isfile(model) and model.endswith(".gguf"):
        from tokenmill.models import gguf  # imports numpy (~70 ms): the API process of a folder model skips it

        return gguf.gguf_to_hf_dir(model, gguf.weights_mode(model, gguf_weights))
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise ValueError(f"model directory {model} has no config.json")
        return model
    if os.path.exists(model):
        raise ValueError(f"model {model!r} is neither a folder nor a .gguf file: pass {MODEL_FORMS}")
    raise ValueError(model_not_found_message(model))


# -- the dtype -------------------------------------------------------------------------------------------------
def _linear_shapes(hf_config: Any) -> list[tuple[int, int]]:
    """[N, K] of a Llama-family decoder layer's linear layers (q|k|v, o, gate|up, down)."""
    H, I = hf_config.hidden_size, hf_config.intermediate_size
    Hq = hf_config.num_attention_heads
    Hkv = getattr(hf_config, "num_key_value_heads", None) or Hq
    D = getattr(hf_config, "head_dim", None) or H // Hq
    return [((Hq + 2 * Hkv) * D, H), (H, Hq * D), (2 * I, H), (H, I)]


def _cpu_auto_dtype(hf_config: Any) -> "torch.dtype":
    """config.DTYPE_AUTO_RULE: the CPU's features decide; a measurement overturns them only clearly and repeatedly
    (matmul_plan.choose_dtype). A timing race alone picked a different dtype on a busy first start (issue 29).
    A GGUF served in its own blocks takes bfloat16 unmeasured: the float matmuls timed here are not what runs.
    Its block kernels quantize bf16 activations to int8 per block (llama.cpp's precision); float32 ones get a
    second int8 pass on the residual, which costs nothing in single-stream decode but twice the integer work
    where it is compute-bound (2-core AVX2 EPYC, float32 -> bfloat16: batched decode at 32 sequences
    1.7x, single-stream decode and prefill about the same)."""
    import torch

    if getattr(hf_config, "tokenmill_gguf_file", None):  # a GGUF served in its own blocks (models/gguf.py)
        logger.info("--dtype auto: bfloat16 (a GGUF served in its own block types: int8 activations in its "
                    "linear layers, as llama.cpp's; --dtype float32 adds a residual pass for ~16-bit ones)")
        return torch.bfloat16
    from tokenmill.layers import cpu_linear, matmul_plan  # import torch: only a cold start measures the dtype

    native = cpu_has_native_bf16()
    prior = torch.bfloat16 if native else torch.float32
    because = f"this CPU {'has' if native else 'lacks'} native bf16 dot products (AVX512_BF16/AMX)"
    try:
        shapes = _linear_shapes(hf_config)
    except (AttributeError, TypeError):  # no config, or not a Llama-family one
        shapes = None
    if shapes is None or not cpu_linear.available() or matmul_plan.forced_path() is not None:
        logger.info("--dtype auto: %s (%s; not measured)", str(prior).removeprefix("torch."), because)
        return prior
    dtype, why = cpu_linear.measured_dtype(shapes, prior)
    logger.info("--dtype auto: %s (%s; %s)", str(dtype).removeprefix("torch."), because, why)
    return dtype


# --dtype spellings -> torch dtype attribute names
_DTYPES = {"float32": "float32", "float": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "half": "float16", "fp16": "float16"}


def resolve_dtype(requested: str | torch.dtype, config_dtype: Any, device: str, hf_config: Any = None) -> torch.dtype:
    """--dtype auto follows the config; without one (GGUF): bf16 on CUDA, and on CPU DTYPE_AUTO_RULE
    (_cpu_auto_dtype; measured for hf_config's layer shapes). float16 maps to bf16 on CPU (no fast fp16
    kernels there)."""
    import torch

    if isinstance(requested, torch.dtype):
        dtype = requested
    elif requested == "auto":
        if isinstance(config_dtype, str):
            config_dtype = getattr(torch, _DTYPES.get(config_dtype, ""), None)
        if isinstance(config_dtype, torch.dtype):
            dtype = config_dtype
        elif device == "cuda":
            dtype = torch.bfloat16
        else:
            dtype = _cpu_auto_dtype(hf_config)
    elif requested in _DTYPES:
        dtype = getattr(torch, _DTYPES[requested])
    else:
        raise ValueError(f"unknown dtype {requested!r}; choose one of auto, float32, bfloat16, float16")
    if device == "cpu" and dtype == torch.float16:
        logger.info("float16 is slow on CPU; using bfloat16 instead")
        dtype = torch.bfloat16
    return dtype


# -- the pooler (--task) -------------------------------------------------------------------------------------
def _read_json(path: str) -> Optional[Any]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def resolve_pooler(task: str, model_dir: str, hf_config: Any) -> Optional[PoolerConfig]:
    """The pooler for --task embed, or None (generate). auto is embed for an encoder architecture or a
    sentence-transformers folder (modules.json), as vLLM decides its runner. The folder's Pooling module and
    a Normalize module decide method and normalization; without one: last-token, normalized (vLLM's default for
    decoders) or CLS for an encoder."""
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    archs = getattr(hf_config, "architectures", None) or []
    encoder = any(a in ENCODER_ARCHITECTURES for a in archs)
    modules = _read_json(os.path.join(model_dir, "modules.json")) if os.path.isdir(model_dir) else None
    if task == "generate" and encoder:
        raise ValueError(f"{', '.join(archs)} is an encoder: it cannot generate text; serve it with --task embed")
    if task == "generate" or (task == "auto" and not encoder and modules is None):
        return None
    pc = PoolerConfig(method="cls" if encoder else "last", encoder=encoder)
    for module in modules or []:
        if str(module.get("type", "")).endswith(".Pooling"):
            pool = _read_json(os.path.join(model_dir, module.get("path", ""), "config.json")) or {}
            modes = [m for m, key in (("mean", "pooling_mode_mean_tokens"), ("cls", "pooling_mode_cls_token"),
                                      ("last", "pooling_mode_lasttoken")) if pool.get(key)]
            if len(modes) != 1:
                raise ValueError(f"{module.get('path')}/config.json: tokenmill pools by exactly one of "
                                 f"{', '.join(POOLING_METHODS)} tokens; this asks for {modes or 'none of them'}")
            pc.method = modes[0]
    if modules is not None:
        pc.normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        st = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
        pc.max_seq_length = st.get("max_seq_length")
    pc.is_matryoshka = bool(getattr(hf_config, "is_matryoshka", False))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    pc.matryoshka_dimensions = list(dims) if dims else None
    return pc
