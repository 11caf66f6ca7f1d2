"""Which kernels an engine runs and which slower paths it fell back to, with the reasons.

`report(model, kv_caches, device)` is the one source of these facts: the worker logs it once at startup
(`announce`), the engine process sends it to the API process (EngineReady.kernels, shown by /version), and
with TOKENMILL_REQUIRE_KERNELS=1 any fallback is an error at startup, so that no benchmark figure is taken on
a slow path by accident. A fallback is a slower path this machine should not need: a C kernel library that
did not build, linear weights left unpacked by the packing budget, the one-call decoder stack off for such a
reason, CUDA without Triton. Paths the model or its settings choose (a quantized checkpoint, float16 on CPU,
an 8-bit KV cache turning the decoder stack off) are reported but are not fallbacks.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from tokenmill.host import cpu_has_native_bf16
from tokenmill.layers import batch_invariant, cpu_build, cpu_fused, cpu_linear, matmul_plan
from tokenmill.layers.attention import cpu_kernels
from tokenmill.layers.linear import LinearBase
from tokenmill.layers.quantization import ggml
from tokenmill.layers.quantization import kernels as qkernels
from tokenmill.models import cpu_stack

logger = logging.getLogger("tokenmill")

REQUIRE_ENV = "TOKENMILL_REQUIRE_KERNELS"
_QFMT_NAMES = {0: "int8", 1: "fp8", 2: "mxfp4", 3: "nvfp4"}  # quantization/kernels.py QFMT_*
UNPACKED = "unpacked-skinny-c/torch"  # a panel kernel exists but the packing budget had no room


def load_all_libraries() -> dict[str, str]:
    """Build and load every C kernel library (what an install must be able to do): name -> status."""
    loaders = (cpu_fused.available, cpu_linear.available, cpu_kernels.load, qkernels.load, ggml.load,
               cpu_stack.available)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # one compiler process per library, side by side
        list(pool.map(lambda load: load(), loaders))
    return cpu_build.library_status()


def report(model, kv_caches: list[torch.Tensor], device: str, kv_layout=None) -> dict:
    """{"attention", "linear", "matmul_plan", "norm_act_rope", "decoder_stack", "block_types", "kv_groups",
    "libraries", "fallbacks"} for this engine (block_types: each ggml type of its block weights -> the kernel
    running it; kv_groups: the step/kv_groups.KVLayout's line, which says why sliding windows only mask where
    the engine keeps one group: a setting's choice, not a fallback)."""
    dtype = model.dtype  # (a later pipeline stage has no embedding)
    stack, stack_fallback = cpu_stack.status(model, kv_caches)  # loads the last library the engine uses
    libraries = cpu_build.library_status()
    fallbacks = _library_fallbacks(libraries)
    attn = model.layers[0].self_attn  # an encoder's has no paged backend (layers/attention/bidirectional.py)
    if hasattr(attn, "attention_path"):  # an attention outside the backends names its path (attention/mla.py)
        attention = attn.attention_path
    else:
        attention = _attention(attn.backend, device, dtype, fallbacks) if hasattr(attn, "backend") \
            else "sdpa-bidirectional"
    kernels = {"attention": attention,
               "linear": _linear(model, fallbacks), "matmul_plan": _matmul_plan(model),
               "norm_act_rope": _fused(device, dtype),
               "decoder_stack": stack, "block_types": _block_types(model, dtype, fallbacks),
               "kv_groups": kv_layout.describe() if kv_layout is not None else "1 group", "libraries": libraries,
               "fallbacks": fallbacks}
    if stack_fallback is not None:
        fallbacks.append(f"decoder stack off: {stack_fallback}")
    return kernels


def _library_fallbacks(libraries: dict[str, str]) -> list[str]:
    """One line per distinct failure, naming every library it hit."""
    by_state: dict[str, list[str]] = {}
    for name, state in sorted(libraries.items()):
        if state != "loaded":
            by_state.setdefault(state, []).append(name)
    return [f"C kernel {'libraries' if len(names) > 1 else 'library'} {', '.join(names)} {state}"
            for state, names in by_state.items()]


def _fused(device: str, dtype: torch.dtype) -> str:
    """RMSNorm (+ residual), SiLU-and-multiply and rotary embedding (layers/cpu_fused.py or torch)."""
    usable = device == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_fused.available()
    return "cpu-fused-c" if usable else "torch"


def _attention(backend, device: str, dtype: torch.dtype, fallbacks: list[str]) -> str:
    """The decode attention path (prefills always run torch SDPA)."""
    if backend.kernel is not None and dtype in backend.kernel_dtypes:
        return {"cpu_paged": "cpu-paged-c", "triton_paged": "triton-paged"}.get(backend.name, backend.name)
    if device == "cuda" and backend.kernel is None:
        fallbacks.append("CUDA without Triton: decode attention runs gathered SDPA (install triton)")
    return "sdpa-gathered"


def _linear(model, fallbacks: list[str]) -> str:
    """The matmul paths of the model's linear layers, e.g. "panel-gemm-bf16" or "qlinear-c-int8 x14, ..."."""
    paths = Counter(_linear_path(layer) for layer in model.modules() if isinstance(layer, LinearBase))
    unpacked = paths.get(UNPACKED, 0)
    if unpacked:
        fallbacks.append(f"packed-weight budget ({cpu_linear.pack_budget_fraction() * 100:.3g}% of RAM, "
                         f"TOKENMILL_PACK_BUDGET_FRACTION) exhausted: {unpacked} of {sum(paths.values())} linear "
                         f"layers run unpacked")
    if len(paths) == 1:
        return next(iter(paths))
    return ", ".join(f"{path} x{count}" for path, count in paths.most_common())


def _matmul_plan(model) -> dict[str, str]:
    """Row class -> the path serving it, over the packed linear layers (matmul_plan.py); {} when none."""
    plans = [(name, layer.packed_weight.plan) for name, layer in model.named_modules()
             if isinstance(layer, LinearBase) and getattr(layer, "packed_weight", None) is not None]
    return matmul_plan.describe(plans) if plans else {}


def _block_linears(model) -> list:
    """The bound ggml.BlockLinears of the model's block layers (a GGUF's, int4) and MoE experts."""
    found = []
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        found += [getattr(method, "block_linear", None)] + list(getattr(method, "w13", None) or []) + \
            list(getattr(method, "w2", None) or [])
    return [b for b in found if b is not None and hasattr(b, "parts")]


def _block_types(model, dtype: torch.dtype, fallbacks: list[str]) -> dict[str, str]:
    """ggml type name -> its kernel, e.g. "avx512-vnni int8 dot (1-32 rows); bf16 tiles + torch GEMM (more)"."""
    linears = _block_linears(model)
    if not linears:
        return {}
    types = sorted({p.type for b in linears for p in b.parts})
    isa = ggml.isa()
    # a type's row limit for x in the model's dtype: the smallest of the layers holding it (a merged layer takes
    # its parts' smallest); past any step's rows, "all rows"
    limit = {t: min(b.row_limit(dtype) for b in linears if any(p.type == t for p in b.parts)) for t in types}
    rows = {t: f"1-{n} rows" if n < ggml.NO_ROW_LIMIT else "all rows" for t, n in limit.items()}
    if isa == "torch":
        fallbacks.append("ggml block kernels unavailable: GGUF/int4 layers run dequantized float weights")
        return {ggml.TYPE_NAMES[t]: "torch (dequantized float weights)" for t in types}
    tiles = "bf16" if cpu_has_native_bf16() and dtype != torch.float32 else "f32"  # as BlockLinear._tiled
    # keyed by the file's type; an x8 layout (rows repacked 8 at a time) says so in its kernel, and so does Q6_K's
    # tile decoding where it is not repacked (ggml.c's x6k_regroup: AVX2 without VNNI, not batch-invariant)
    decoded = isa == "avx2" and not batch_invariant.enabled()

    def how(t: int) -> str:
        if t in ggml.BASE_TYPE:
            return ", rows repacked 8 at a time"
        return ", 8-row tiles decoded at 16+ rows of x" if t == ggml.Q6_K and decoded else ""

    return {ggml.TYPE_NAMES[ggml.BASE_TYPE.get(t, t)]: (
        f"float dot ({rows[t]})" if t in ggml.FLOAT_TYPES else f"{isa} int8 dot{how(t)} ({rows[t]})")
        + (f"; {tiles} tiles + torch GEMM (more)" if limit[t] < ggml.NO_ROW_LIMIT else "") for t in types}


def _linear_path(layer) -> str:
    method, weight = layer.quant_method, layer.weight
    blocks = getattr(method, "block_linear", None)
    if blocks is not None:  # ggml blocks: a GGUF's own, or int4
        return "ggml-" + "+".join(sorted({ggml.TYPE_NAMES[p.type] for p in blocks.parts}))
    if hasattr(method, "fmt"):  # quantization/base.py PackedLinearMethod
        if getattr(method, "run", None) is None or weight.device.type != "cpu":
            return "torch-dequant"
        name = "w8a8" if getattr(method, "activations", False) else _QFMT_NAMES.get(method.fmt, str(method.fmt))
        return f"qlinear-c-{name}"
    if weight.device.type != "cpu":
        return "torch"
    if getattr(layer, "packed_weight", None) is not None:
        return "panel-gemm-" + ("bf16" if weight.dtype == torch.bfloat16 else "f32")
    if cpu_linear.packable(weight):
        return UNPACKED
    return "torch"


def require_kernels() -> bool:
    value = os.environ.get(REQUIRE_ENV, "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"{REQUIRE_ENV} must be 0 or 1, not {value!r}")
    return value == "1"


@contextlib.contextmanager
def kernels_required():
    """Engines started inside this block run with TOKENMILL_REQUIRE_KERNELS=1 unless the environment says
    otherwise (benchmarks: no speed figure from a slow path); the environment is restored afterwards."""
    before = os.environ.get(REQUIRE_ENV)
    os.environ.setdefault(REQUIRE_ENV, "1")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(REQUIRE_ENV, None)


def announce(kernels: dict) -> None:
    """Log the report once (the paths in use, then each fallback with its reason); with
    TOKENMILL_REQUIRE_KERNELS=1 raise on any fallback instead."""
    fallbacks = kernels["fallbacks"]
    logger.info("kernels: attention=%s, linear=%s, norm/act/rope=%s, decoder stack=%s", kernels["attention"],
                kernels["linear"], kernels["norm_act_rope"], kernels["decoder_stack"])
    for rows, path in kernels.get("matmul_plan", {}).items():
        logger.info("matmul plan, %s: %s", rows, path)
    for type_name, kernel in kernels.get("block_types", {}).items():
        logger.info("ggml %s weights: %s", type_name, kernel)
    if fallbacks and require_kernels():
        raise RuntimeError(f"{REQUIRE_ENV}=1 but the engine would run slow paths: {'; '.join(fallbacks)}")
    for fallback in fallbacks:
        logger.warning("slow path: %s (%s=1 makes this an error)", fallback, REQUIRE_ENV)
