"""GGUF checkpoints: served in their own block formats (native), or converted to a float HF directory.

Either way the engine loads a cached HF-style directory `<cache>/gguf/<key>/` holding `config.json`,
tokenizer files and `generation_config.json`:
- `--gguf-weights native` (the default for a quantized GGUF): no weights in it; config.json names the GGUF
  file (`tokenmill_gguf_file`) and the loader (`GgufWeights`) hands the model each tensor in its own type,
  memory-mapped from the file: quantized ones as `BlockTensor`s (ggml blocks, run by the block kernels of
  layers/quantization/ggml), float ones (norms) as tensors. Nothing is written but the tokenizer and config.
- `--gguf-weights dequantize` (and any GGUF whose weights are all float): a float32 `model.safetensors` too,
  the exact dequantized weights, loaded as any HF checkpoint (for exactness work against transformers).
The key hashes (converter version, mode, absolute path, size, mtime_ns), so an edited or replaced file is
converted again and a warm start is a single `stat`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import numpy as np

from tokenmill.host import cache_root, release_free_heap

if TYPE_CHECKING:  # annotations only: the API process and plan import this module without torch
    import torch

logger = logging.getLogger("tokenmill")

_CONVERTER_VERSION = 5  # bump whenever the output changes, so stale cache entries are not reused

# GGUF architecture -> (HF class, HF model_type). Mistral GGUFs use the "llama" architecture.
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "deepseek2": ("DeepseekV2ForCausalLM", "deepseek_v2"),  # V3 where its router is a sigmoid (_deepseek2_config)
}
# Mixture-of-experts tensors: the router, and the experts stacked [E, ...] in one tensor per projection.
# A "llama" GGUF with experts is Mixtral.
_ROUTER = "ffn_gate_inp"
_EXPERT_STACKS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}  # -> index in _EXPERT_NAMES
_EXPERT_NAMES = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
                 "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "deepseek_v2": ("mlp", ("gate_proj", "up_proj", "down_proj")),
                 "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}
GGUF_WEIGHTS = ("auto", "native", "dequantize")  # --gguf-weights
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma's four norms per layer (llama.cpp's gguf-py constants: ATTN_POST_NORM, FFN_PRE_NORM, FFN_POST_NORM)
_ARCH_LAYER_NAMES = {"gemma3": {"post_attention_norm": "post_attention_layernorm",
                                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
                     # DeepSeek's latent attention, shared experts and router bias (gguf-py's DEEPSEEK2 tensors)
                     "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_b": "self_attn.q_b_proj",
                                   "attn_q_a_norm": "self_attn.q_a_layernorm",
                                   "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                                   "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                                   "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                                   "ffn_up_shexp": "mlp.shared_experts.up_proj",
                                   "ffn_down_shexp": "mlp.shared_experts.down_proj"}}
# Newer llama.cpp converters split DeepSeek's kv_b_proj per head into attn_k_b [H, L, nope] (transposed) and
# attn_v_b [H, v, L]; they become one kv_b_proj [H * (nope + v), L] again here (_Entry.parts).
_KV_B_PARTS = ("attn_k_b", "attn_v_b")
# llama.cpp's converter stores Gemma's norm weights as 1 + w (its RMSNorm multiplies by the weight as stored);
# the HF weight, which the model and transformers load, is the file's minus this.
_NORM_SHIFT = {"gemma3": 1.0}
# Metadata arrays kept (the others, e.g. the vocabulary, are skipped): llama.cpp's per-layer sliding-window flags
_KEPT_ARRAYS = (".attention.sliding_window_pattern",)


def weights_mode(gguf_path: str, requested: str = "auto") -> str:
    """--gguf-weights: native or dequantize; auto is native when the file holds quantized weights."""
    if requested not in GGUF_WEIGHTS:
        raise ValueError(f"--gguf-weights must be one of {', '.join(GGUF_WEIGHTS)}, got {requested!r}")
    if requested != "auto":
        return requested
    if _cache_dir(gguf_path, "native").is_dir():  # decided before (a header parse reads the whole vocabulary)
        return "native"
    reader, _ = _read(os.path.abspath(gguf_path))
    quantized = any(t.tensor_type.name not in _FLOAT_TYPES for t in reader.tensors)
    return "native" if quantized else "dequantize"


def read_config(gguf_path: str) -> dict:
    """The Hugging Face config.json fields of a GGUF file (nothing written)."""
    path = os.path.abspath(gguf_path)
    reader, meta = _read(path)
    return _hf_config(path, meta["general.architecture"], meta, _shapes(reader), _rope_freqs(reader))


def weight_bits(gguf_path: str) -> tuple[float, dict[str, float]]:
    """(bits per weight over all of the file's tensors, as served natively: their real block bytes, scales
    included; e.g. Q4_K 4.5, Q6_K 6.5625) and each type's share of the weights."""
    reader, _ = _read(os.path.abspath(gguf_path))
    elements: dict[str, int] = {}
    nbytes = 0
    for t in reader.tensors:
        elements[t.tensor_type.name] = elements.get(t.tensor_type.name, 0) + int(np.prod(t.shape))
        nbytes += t.n_bytes
    total = sum(elements.values())
    return 8 * nbytes / total, {k: v / total for k, v in sorted(elements.items(), key=lambda kv: -kv[1])}


def gguf_to_hf_dir(gguf_path: str, weights: str = "dequantize") -> str:
    """Return the HF-style model directory for `gguf_path` (weights: native or dequantize, see the module
    docstring), making it on first use."""
    if weights not in ("native", "dequantize"):
        raise ValueError(f"weights must be native or dequantize, got {weights!r}")
    path = os.path.abspath(gguf_path)
    final = _cache_dir(path, weights)
    if final.is_dir():  # only complete conversions are ever renamed into place
        return str(final)

    t0 = time.perf_counter()
    reader, meta = _read(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        logger.info("%s GGUF %s -> %s", "reading" if weights == "native" else "converting", path, final)
        _convert(path, reader, meta, tmp, native=weights == "native")
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            logger.info("another process converted %s first; using its result", path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1fs", path, time.perf_counter() - t0)
    release_free_heap()  # the metadata arrays (and transformers' GGUF tokenizer reader) were Python objects
    return str(final)


def _cache_dir(gguf_path: str, weights: str) -> Path:
    path = os.path.abspath(gguf_path)
    st = os.stat(path)
    key = f"{_CONVERTER_VERSION}\0{weights}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    suffix = "-native" if weights == "native" else ""
    return _cache_parent() / f"{Path(path).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}{suffix}"


def _cache_parent() -> Path:
    return Path(cache_root()) / "gguf"


# A converted folder's tokenizer is served as its tokenizer.json says: the pipeline transformers' GGUF converter
# built from the file's tokenizer.ggml.pre, as llama.cpp splits text. AutoTokenizer would load some model types'
# own class instead, which rebuilds its pre-tokenizer from the vocabulary (Qwen2Tokenizer: Qwen2's split, digits
# one by one) whatever the file said (a DeepSeek-R1 distill of Qwen2 says "deepseek-r1-qwen": digits in threes).
TOKENIZER_CLASS = "transformers:PreTrainedTokenizerFast"


def tokenizer_class(tokenizer_dir: str) -> Optional[str]:
    """The "module:name" tokenizer class for a converted folder (TOKENIZER_CLASS), None for any other."""
    return TOKENIZER_CLASS if Path(tokenizer_dir).resolve().parent == _cache_parent().resolve() else None


def _read(path: str):
    """(the file's tensors, its scalar metadata), turning any parse failure into a one-line ValueError."""
    try:
        reader = _Scan(path)
    except Exception as e:  # truncated or corrupt files fail in assorted ways
        msg = " ".join(str(e).split())
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {msg})") from e
    meta = reader.meta
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")
    for t in reader.tensors:
        if t.tensor_type.name not in _SUPPORTED_TYPES:
            raise ValueError(f"{path}: unsupported GGUF tensor type {t.tensor_type.name} (tensor {t.name})")
    return reader, meta


class _Tensor(NamedTuple):
    """A tensor of the file, as gguf-py's reader describes it: dims in GGUF order (innermost first), data a
    numpy view of the mapped file (float types as float arrays, block types as bytes [..., row bytes])."""
    name: str
    shape: tuple
    tensor_type: Any
    data: np.ndarray
    n_bytes: int


# GGUF metadata value types -> struct format (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Scan:
    """The GGUF header without its arrays: scalar metadata (`meta`; arrays such as the vocabulary are skipped,
    the tokenizer converter reads them) and the tensor table, over a copy-on-write map of the file. gguf-py's
    GGUFReader materializes every array element as a numpy object: ~360 MB of Python heap for a 152k-token
    vocabulary, which outlived nothing but made the peak."""

    def __init__(self, path: str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.mm = np.memmap(path, mode="c")
        buf, self.pos = self.mm, 4
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("bad magic")
        version, n_tensors, n_kv = self._unpack("<IQQ")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        self.meta = {}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._unpack("<I")[0], keep=key.endswith(_KEPT_ARRAYS))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = self._unpack(f"<{self._unpack('<I')[0]}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        align = int(self.meta.get("general.alignment") or 32)
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, dims, kind, offset in infos:
            values, nbytes = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims))
            size = count * nbytes // values
            if start + offset + size > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = buf[start + offset:start + offset + size]
            np_dims = tuple(int(d) for d in reversed(dims))
            if kind.name in ("F32", "F16"):
                data = raw.view(np.float32 if kind.name == "F32" else np.float16).reshape(np_dims)
            else:  # bytes, rows of blocks (gguf-py's quant_shape_to_byte_shape)
                data = raw.reshape(*np_dims[:-1], np_dims[-1] // values * nbytes)
            self.tensors.append(_Tensor(name, dims, kind, data, size))

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self.mm, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        out = self.mm[self.pos:self.pos + n].tobytes().decode("utf-8")
        self.pos += n
        return out

    def _value(self, kind: int, keep: bool = False):
        if kind == 8:
            return self._string()
        if kind == 9:  # an array: skipped, or read where `keep` (a short array of numbers)
            elem, count = self._unpack("<IQ")
            if keep and elem in _SCALARS:
                return list(self._unpack(f"<{count}{_SCALARS[elem][1:]}"))
            if elem == 8:  # each string: its uint64 length, then its bytes
                length, mm = struct.Struct("<Q").unpack_from, self.mm
                for _ in range(count):
                    self.pos += 8 + length(mm, self.pos)[0]
            elif elem == 9:
                raise ValueError("nested metadata arrays are not supported")
            else:
                self.pos += count * struct.calcsize(_SCALARS[elem])
            return None
        value = self._unpack(_SCALARS[kind])[0]
        return float(str(np.float32(value))) if kind == 6 else value  # shortest float32 repr: 1e-05


def _convert(path: str, reader, meta: dict, out: Path, native: bool) -> None:
    arch = meta["general.architecture"]
    config = _hf_config(path, arch, meta, _shapes(reader), _rope_freqs(reader))
    if native:
        config["tokenmill_gguf_file"] = path
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if not native:
        _write_safetensors(out / "model.safetensors", _hf_tensors(path, reader, arch, config))
    end_ids = _save_tokenizer(path, meta, config, out)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    if len(end_ids) > 1:  # the eos first, then the other end-of-turn tokens (frontend.eos_token_ids reads them)
        gen["eos_token_id"] = end_ids
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def _shapes(reader) -> dict:
    return {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}  # GGUF lists dims reversed


def _rope_freqs(reader) -> Optional[np.ndarray]:
    """The file's rope_freqs.weight (Llama 3's rope scaling, as llama.cpp's converter writes it), if any."""
    t = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return None if t is None else np.asarray(t.data, dtype=np.float64)


def _hf_config(path: str, arch: str, meta: dict, shapes: dict, rope_freqs: Optional[np.ndarray] = None) -> dict:
    def need(key):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    # rope.dimension_count equals head_dim for llama; other archs state key_length or use hidden // heads
    head_dim = meta.get(f"{arch}.attention.key_length") or (
        meta.get(f"{arch}.rope.dimension_count") if arch == "llama" else None) or hidden // heads
    hf_class, model_type = _ARCHS[arch]
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        # the embedding matrix is authoritative: Qwen pads it past the tokenizer's size
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "tokenmill_source": "gguf",  # no dtype on purpose: the engine picks one for dtype-less configs
    }
    if arch != "deepseek2":
        _moe_config(config, arch, meta, need, shapes)
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in shapes
        config["mlp_bias"] = "blk.0.ffn_up.bias" in shapes
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
        if scaling == "yarn":
            config["rope_scaling"]["original_max_position_embeddings"] = meta.get(
                f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
    elif scaling not in (None, "none"):
        raise ValueError(f"{path}: unsupported GGUF rope scaling {scaling!r}")
    if rope_freqs is not None:
        if "rope_scaling" in config:
            raise ValueError(f"{path}: both rope_freqs.weight and {arch}.rope.scaling.type {scaling!r}")
        config["rope_scaling"] = _llama3_rope(path, config, rope_freqs)
    if arch == "gemma3":
        _gemma3_config(path, config, meta)
    if arch == "deepseek2":
        _deepseek2_config(path, config, meta, need)
    return config


def llama3_divisors(theta: float, head_dim: int, rope: dict) -> np.ndarray:
    """What each rotary frequency is divided by under Llama 3's rope scaling `rope` (transformers' llama3 rope and
    llama.cpp's converter alike): the rope_freqs.weight a GGUF of such a model holds."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor, original = rope["factor"], rope["original_max_position_embeddings"]
    low, high = original / rope["low_freq_factor"], original / rope["high_freq_factor"]  # wavelengths
    wavelen = 2 * np.pi / inv_freq
    with np.errstate(divide="ignore", invalid="ignore"):
        smooth = (1 / wavelen - 1 / low) / (1 / high - 1 / low)
        medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, factor, medium))


def _llama3_params(factor: float, low: float, high: float) -> dict:
    """Llama 3's rope scaling with the divisor leaving `factor` at wavelength `low` and reaching 1 at `high`,
    in round numbers where they are (Llama 3's: original_max_position_embeddings 8192, low_freq_factor 1)."""
    original = round(low) if abs(low - round(low)) < 1e-3 * low else float(low)
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(float(original / low), 6),
            "high_freq_factor": round(float(original / high), 6), "original_max_position_embeddings": original}


def _llama3_rope(path: str, config: dict, divisors: np.ndarray) -> dict:
    """The rope_scaling whose divisors are the file's `rope_freqs.weight`. llama.cpp's converter writes Llama 3's
    rope scaling only as that tensor: each rotary frequency's divisor, 1 for short wavelengths, `factor` for long
    ones and in between 1 / ((1 - s) / factor + s), s linear in 1 / wavelength. The divisors fix everything
    transformers' llama3 rope depends on: the factor and the two wavelengths where s is 0 and 1, solved from the
    in-between divisors (or placed between their neighbours where there are too few). Checked against the
    file: divisors of any other shape are refused rather than served with the wrong rope."""
    head_dim = config["head_dim"]
    inv_freq = 1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    bad = ValueError(f"{path}: rope_freqs.weight is not a Llama 3 rope scaling (its {len(divisors)} divisors; "
                     f"expected {len(inv_freq)} going from 1 up to the scaling factor)")
    if divisors.shape != inv_freq.shape or not np.all(np.isfinite(divisors)) or divisors.min() < 1:
        raise bad
    factor = float(divisors.max())
    if factor == 1.0:
        return {"rope_type": "default"}
    wavelen = 2 * np.pi / inv_freq
    is_short, is_long = np.isclose(divisors, 1.0, rtol=1e-6), np.isclose(divisors, factor, rtol=1e-6)
    short_w = wavelen[is_short].max() if is_short.any() else wavelen.min() / 2
    long_w = wavelen[is_long].min() if is_long.any() else wavelen.max() * 2
    between = ~is_short & ~is_long
    w, s = wavelen[between], (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    if len(s) >= 2:  # s = (1/w - 1/low) / (1/high - 1/low): a line in 1/w through the in-between divisors
        slope, offset = np.polyfit(1 / w, s, 1)
        candidates = [(-slope / offset, slope / (1 - offset))]
    elif len(s) == 1:  # one edge between the point and its neighbour, the other through the point
        low, high = np.sqrt(w[0] * long_w), np.sqrt(short_w * w[0])
        candidates = [(low, 1 / ((1 / w[0] - 1 / low) / s[0] + 1 / low)),
                      ((1 - s[0]) / (1 / w[0] - s[0] / high), high)]
    else:  # none: both edges between the neighbouring wavelengths
        candidates = [((short_w * long_w * long_w) ** (1 / 3), (short_w * short_w * long_w) ** (1 / 3))]
    for low, high in candidates:
        params = _llama3_params(factor, float(low), float(high))
        rebuilt = llama3_divisors(config["rope_theta"], head_dim, params)
        if 0 < high < low and np.allclose(rebuilt, divisors, rtol=1e-4):
            return params
    raise bad


def _moe_config(config: dict, arch: str, meta: dict, need, shapes: dict) -> None:
    """Expert fields of a MoE GGUF (llama.cpp renormalises the top-k weights for Mixtral and Qwen3-MoE). A
    Qwen3-MoE layer holding a dense MLP instead of experts is listed in mlp_only_layers."""
    experts = meta.get(f"{arch}.expert_count") or 0
    if not experts:
        return
    config.update(num_local_experts=experts, num_experts_per_tok=need("expert_used_count"))
    if arch == "llama":
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", router_jitter_noise=0.0)
    else:
        config.update(num_experts=experts, moe_intermediate_size=need("expert_feed_forward_length"),
                      norm_topk_prob=bool(meta.get(f"{arch}.expert_weights_norm", True)),
                      decoder_sparse_step=1, mlp_only_layers=[i for i in range(config["num_hidden_layers"])
                                                              if f"blk.{i}.ffn_gate.weight" in shapes])


def _deepseek2_config(path: str, config: dict, meta: dict, need) -> None:
    """DeepSeek-V2/V3's fields from llama.cpp's deepseek2 keys, in transformers' DeepseekV2/V3Config terms. A
    sigmoid router (expert_gating_func 2) is V3. The converter writes the MLA shapes as MQA (key_length
    kv_lora_rank + rope, one KV head) with the per-head sizes in key/value_length_mla (older files: in
    key/value_length); YaRN's mscale_all_dim as yarn_log_multiplier = 0.1 x it (its mscale is taken equal, as
    in every released model, so the rope's attention factor is 1)."""
    rope = need("rope.dimension_count")
    key = meta.get("deepseek2.attention.key_length_mla") or need("attention.key_length")
    v3 = meta.get("deepseek2.expert_gating_func") == 2
    groups = meta.get("deepseek2.expert_group_count") or 1
    config.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2", num_key_value_heads=config["num_attention_heads"],
        head_dim=rope, q_lora_rank=meta.get("deepseek2.attention.q_lora_rank"),
        kv_lora_rank=need("attention.kv_lora_rank"), qk_rope_head_dim=rope, qk_nope_head_dim=key - rope,
        v_head_dim=meta.get("deepseek2.attention.value_length_mla") or need("attention.value_length"),
        first_k_dense_replace=meta.get("deepseek2.leading_dense_block_count", 0),
        n_routed_experts=need("expert_count"), num_experts_per_tok=need("expert_used_count"),
        n_shared_experts=meta.get("deepseek2.expert_shared_count", 0),
        moe_intermediate_size=need("expert_feed_forward_length"),
        routed_scaling_factor=meta.get("deepseek2.expert_weights_scale", 1.0),
        norm_topk_prob=bool(meta.get("deepseek2.expert_weights_norm", False)),
        n_group=groups, topk_group=meta.get("deepseek2.expert_group_used_count") or 1)
    if v3:
        config["rope_interleave"] = True
    else:
        config["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    log_mul = meta.get("deepseek2.rope.scaling.yarn_log_multiplier")
    if log_mul and config.get("rope_scaling", {}).get("rope_type") == "yarn":
        mscale = round(log_mul / 0.1, 6)  # the file holds 0.1 x it in float32
        config["rope_scaling"].update(mscale=mscale, mscale_all_dim=mscale)


def _gemma3_config(path: str, config: dict, meta: dict) -> None:
    """Gemma 3's fields as llama.cpp reads them (src/models/gemma3.cpp), in transformers 5's Gemma3TextConfig
    terms. Sliding layers: every layer when gemma3.attention.sliding_window is set, unless
    attention.sliding_window_pattern says otherwise (per-layer flags, or n: layer i slides when i % n < n - 1;
    absent, n = 6: five local layers to one global, as Gemma 3 has); none without a window. rope.freq_base
    (and any rope scaling) is the global layers', rope.freq_base_swa the local ones' (default 10000, unscaled).
    The attention scale is not in the file: llama.cpp takes 1/sqrt(hidden / heads) for the 62-layer 27B and
    1/sqrt(head_dim) otherwise, which is each released model's query_pre_attn_scalar."""
    layers, window = config["num_hidden_layers"], meta.get("gemma3.attention.sliding_window") or 0
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if not window:
        sliding = [False] * layers
    elif isinstance(pattern, list):
        if len(pattern) < layers:
            raise ValueError(f"{path}: gemma3.attention.sliding_window_pattern has {len(pattern)} entries for "
                             f"{layers} layers")
        sliding = [bool(flag) for flag in pattern[:layers]]
    else:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    full = {"rope_type": "default", "rope_theta": config.pop("rope_theta"), **(config.pop("rope_scaling", None) or {})}
    local = {"rope_type": "default", "rope_theta": meta.get("gemma3.rope.freq_base_swa", 10000.0)}
    config.pop("hidden_act")
    config.update(
        hidden_activation="gelu_pytorch_tanh", sliding_window=window or None,
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        rope_parameters={"full_attention": full, "sliding_attention": local},
        query_pre_attn_scalar=config["hidden_size"] // config["num_attention_heads"] if layers == 62
        else config["head_dim"],
        final_logit_softcapping=meta.get("gemma3.final_logit_softcapping"))


class _Entry(NamedTuple):
    """One model tensor of the GGUF file: its HF name and shape, the file tensor, the rows of it (an expert of
    a stacked tensor, or None for all), the head count whose Q/K rows llama.cpp permuted (or None) and what to
    add to the file's values to get the HF weight (Gemma's norms: -1)."""
    hf_name: str
    shape: tuple
    tensor: Any
    expert: Optional[int]
    n_head: Optional[int]
    shift: float = 0.0
    parts: tuple = ()  # DeepSeek's attn_k_b and attn_v_b, which make this kv_b_proj (tensor is the first)


def _entries(path: str, reader, arch: str, config: dict):
    """The file's tensors as the HF model's, in file order (an expert stack becomes one entry per expert)."""
    layer_names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(parts) == 3 and parts[2] in _KV_B_PARTS:
            entry = _kv_b_entry(path, by_name, parts[1], config)
            if parts[2] == _KV_B_PARTS[0] and entry is not None:
                yield entry
            continue
        if len(parts) == 3 and parts[2] == "exp_probs_b":  # V3's router bias, a buffer of the gate in HF
            yield _Entry(f"model.layers.{parts[1]}.mlp.gate.e_score_correction_bias", shape, t, None, None)
            continue
        if base == "rope_freqs":  # in the config as its rope_scaling (_llama3_rope)
            continue
        if base in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[base]
        elif len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
        elif len(parts) == 3 and parts[0] == "blk" and config["model_type"] in _EXPERT_NAMES and \
                parts[2] in (_ROUTER, *_EXPERT_STACKS):
            block, names = _EXPERT_NAMES[config["model_type"]]
            if parts[2] in _EXPERT_STACKS:
                for e in range(shape[0]):
                    name = f"model.layers.{parts[1]}.{block}.experts.{e}.{names[_EXPERT_STACKS[parts[2]]]}.weight"
                    yield _Entry(name, shape[1:], t, e, None)
                continue
            hf = f"model.layers.{parts[1]}.{block}.gate"
        else:
            raise ValueError(f"{path}: unexpected tensor {t.name} for GGUF architecture {arch}")
        n_head = None
        if arch == "llama" and parts[-1] == "attn_q":
            n_head = config["num_attention_heads"]
        elif arch == "llama" and parts[-1] == "attn_k":
            n_head = config["num_key_value_heads"]
        shift = -_NORM_SHIFT.get(arch, 0.0) if hf.endswith("norm") else 0.0
        yield _Entry(f"{hf}.{suffix}", shape, t, None, n_head, shift)


def _kv_b_entry(path: str, by_name: dict, layer: str, config: dict) -> Optional[_Entry]:
    """Layer's kv_b_proj from attn_k_b and attn_v_b, or None where the file has attn_kv_b itself."""
    if f"blk.{layer}.attn_kv_b.weight" in by_name:
        return None
    k_b, v_b = (by_name.get(f"blk.{layer}.{name}.weight") for name in _KV_B_PARTS)
    if k_b is None or v_b is None:
        raise ValueError(f"{path}: layer {layer} has only one of attn_k_b and attn_v_b")
    rows = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["v_head_dim"])
    return _Entry(f"model.layers.{layer}.self_attn.kv_b_proj.weight", (rows, config["kv_lora_rank"]), k_b, None,
                  None, parts=(k_b, v_b))


def _dequantized(t) -> np.ndarray:
    """A file tensor as float32 in its numpy shape (GGUF dims reversed)."""
    from gguf.quants import dequantize

    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(int(d) for d in reversed(t.shape)))


def _joined_kv_b(e: _Entry) -> np.ndarray:
    """kv_b_proj [H * (nope + v), L] from attn_k_b [H, L, nope] and attn_v_b [H, v, L]."""
    k_b, v_b = (_dequantized(t) for t in e.parts)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(e.shape)


def _hf_tensors(path: str, reader, arch: str, config: dict):
    """Yield (hf_name, hf_shape, thunk producing float32 data) in file order; data is made lazily (an expert
    stack is dequantized once and shared by its experts' thunks, which the writer takes in order)."""
    from gguf.quants import dequantize

    stack: dict = {}

    def make(e: _Entry) -> np.ndarray:
        if e.parts:
            return _joined_kv_b(e)
        if e.expert is None:
            w = np.asarray(dequantize(e.tensor.data, e.tensor.tensor_type), dtype=np.float32).reshape(e.shape)
            w = w + np.float32(e.shift) if e.shift else w
            return w if e.n_head is None else _unpermute_rope_rows(w, e.n_head)
        if stack.get("t") is not e.tensor:
            stack.update(t=e.tensor, w=np.asarray(dequantize(e.tensor.data, e.tensor.tensor_type),
                                                  dtype=np.float32).reshape((-1, *e.shape)))
        return stack["w"][e.expert]

    for e in _entries(path, reader, arch, config):
        yield e.hf_name, e.shape, (lambda e=e: make(e))


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's Q/K rows from HF's "first half | second half" rotary
    # layout to interleaved pairs (row 2i <- i, row 2i+1 <- i + d/2); this is the inverse.
    return w.reshape(n_head, -1, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_safetensors(file: Path, tensors) -> None:
    """Write float32 tensors one at a time, so peak memory is one tensor rather than the model."""
    tensors = list(tensors)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in tensors:
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format allows space padding; keeps tensor data 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, shape, make in tensors:
            data = np.ascontiguousarray(make(), dtype="<f4")
            assert data.shape == shape, (name, data.shape, shape)
            f.write(data.tobytes())


# Chat-turn end tokens llama.cpp also stops at (its end-of-generation set) where a file's eos is another
# token: Gemma's instruct GGUFs end turns with <end_of_turn> and keep <eos> as eos.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<｜end▁of▁sentence｜>")


# GGUF architectures whose files transformers' GGUF loader refuses as a whole: their tokenizer is built from the
# metadata by transformers' own GGUF tokenizer converter, which does not look at the architecture.
_TOKENIZER_ONLY = ("deepseek2",)


def _gguf_tokenizer(path: str, arch: str, model_type: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    if arch not in _TOKENIZER_ONLY:
        # the class AutoTokenizer picks for the model type (its registered one, else PreTrainedTokenizerFast),
        # without its config step, which for most architectures parses the whole file with gguf-py's reader:
        # 11.6 of 12.6 s for a 152k-token Qwen2 vocabulary, the same tokenizer either way
        folder, name = os.path.dirname(path), os.path.basename(path)
        if TOKENIZER_MAPPING_NAMES.get(model_type):
            return AutoTokenizer.from_pretrained(folder, gguf_file=name, tokenizer_type=model_type)
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(path)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    special = {k: v for k, v in {**tokenizer_config, **extra}.items() if v is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


def _save_tokenizer(path: str, meta: dict, config: dict, out: Path) -> list[int]:
    """Write the file's tokenizer as a Hugging Face one; returns the ids that end a generation (eos first)."""
    tok = _gguf_tokenizer(path, meta["general.architecture"], config["model_type"])
    # make the special tokens agree with the GGUF's ids, whatever the converter inferred
    for attr in ("bos", "eos", "pad"):
        token_id = config.get(f"{attr}_token_id")
        if token_id is not None and getattr(tok, f"{attr}_token_id") != token_id:
            setattr(tok, f"{attr}_token", tok.convert_ids_to_tokens(token_id))
    if tok.chat_template is None and meta.get("tokenizer.chat_template"):
        tok.chat_template = meta["tokenizer.chat_template"]
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(out)
    vocab = tok.get_vocab()
    ends = [config.get("eos_token_id"), meta.get("tokenizer.ggml.eot_token_id"),
            meta.get("tokenizer.ggml.eom_token_id"), *(vocab.get(name) for name in END_OF_TURN_TOKENS)]
    return list(dict.fromkeys(i for i in ends if isinstance(i, int)))


# -- native weights -----------------------------------------------------------------------------------------
class BlockTensor:
    """A GGUF weight [N, K] kept in its ggml block type: `data` is uint8 [N, row_bytes] over the memory-mapped
    file (a copy only where llama.cpp permuted Q/K rows). Block-aware loaders take `part(...)`: a rank's rows
    and block-aligned columns as a ggml.Part, without copying. Any other loader indexes it like a tensor and
    gets float32 (the dequantized rows: e.g. MoE experts, which the float MoE layer runs)."""

    def __init__(self, data: "torch.Tensor", ggml_type: int, shape: tuple, owner: "GgufWeights") -> None:
        self.data, self.ggml_type, self.shape, self._owner = data, ggml_type, tuple(shape), owner

    def splits_at(self, cols: tuple[int, int]) -> bool:
        """Whether columns [start, start + count) fall on whole blocks (a row-parallel rank's slice)."""
        from tokenmill.layers.quantization import ggml  # imports torch: the API process and plan import this module

        values = ggml.block_size(self.ggml_type)[0]
        return cols[0] % values == 0 and cols[1] % values == 0

    def part(self, rows: tuple[int, int], cols: tuple[int, int]):
        """Rows [start, start + count) and columns [start, start + count) as a ggml.Part (a strided view)."""
        from tokenmill.layers.quantization import ggml  # imports torch, as in splits_at

        values, nbytes = ggml.block_size(self.ggml_type)
        (r0, nr), (c0, nc) = rows, cols
        if c0 % values or nc % values:
            raise ValueError(f"columns [{c0}, {c0 + nc}) of a {ggml.TYPE_NAMES[self.ggml_type]} tensor do not fall "
                             f"on its {values}-value blocks (tensor-parallel split of the input dimension)")
        data = self.data[r0:r0 + nr, c0 // values * nbytes:(c0 + nc) // values * nbytes]
        self._owner.bytes_read += data.shape[0] * data.shape[1]
        return ggml.Part(self.ggml_type, data)

    def __getitem__(self, index) -> "torch.Tensor":
        import torch
        from gguf.quants import dequantize

        self._owner.bytes_read += self.data.numel()
        w = dequantize(self.data.numpy(), self._owner.quant_type(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(self.shape))[index]


class GgufWeights:
    """Iterates (HF name, tensor) over a GGUF file for a model's load_weights, every tensor in its own type:
    quantized ones as BlockTensors, float ones as tensors (float32, float16 or bfloat16 views of the file).
    `types` maps each HF name to its ggml type id before loading (the quant config picks methods by it);
    bytes_read counts what loaders took."""

    def __init__(self, path: str, config) -> None:
        self.path = path
        self.reader, meta = _read(path)
        arch = meta["general.architecture"]
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        self.entries = list(_entries(path, self.reader, arch, cfg))
        self.types = {e.hf_name: int(e.tensor.tensor_type) for e in self.entries}
        self.bytes_read, self.bytes_total = 0, os.path.getsize(path)

    @staticmethod
    def quant_type(type_id: int):
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(type_id)

    def __iter__(self):
        for e in self.entries:
            yield e.hf_name, self._tensor(e)

    def _tensor(self, e: _Entry):
        import torch

        if e.parts:  # a float copy: the model keeps kv_b_proj in its dtype (layers/attention/mla.py)
            out = torch.from_numpy(_joined_kv_b(e))
            self.bytes_read += sum(t.n_bytes for t in e.parts)
            return out
        t, rows = e.tensor, e.shape[0]
        name = t.tensor_type.name
        data = np.asarray(t.data)
        if e.expert is not None:
            data = data.reshape(-1, *data.shape[-1:])[e.expert * rows:(e.expert + 1) * rows]
        if name == "BF16":
            out = torch.from_numpy(data.view(np.uint16).reshape(e.shape)).view(torch.bfloat16)
        elif name in _FLOAT_TYPES:
            out = torch.from_numpy(data.reshape(e.shape))
        else:
            out = BlockTensor(torch.from_numpy(data.reshape(rows, -1)), int(t.tensor_type), e.shape, self)
        if e.n_head is not None:
            out = _unpermute(out, e.n_head)
        if e.shift:  # a norm (float in llama.cpp's files; a block one dequantized here): a copy of this small tensor
            out = out[...].float() + e.shift
        if not isinstance(out, BlockTensor):
            self.bytes_read += out.numel() * out.element_size()
        return out


def _unpermute(t, n_head: int):
    """_unpermute_rope_rows for a float tensor or a BlockTensor (whole rows move: a copy of this tensor)."""
    import torch

    rows = torch.arange(t.shape[0]).reshape(n_head, -1, 2).transpose(1, 2).reshape(-1)
    if isinstance(t, BlockTensor):
        return BlockTensor(t.data[rows].contiguous(), t.ggml_type, t.shape, t._owner)
    return t[rows]
