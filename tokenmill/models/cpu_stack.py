"""Runs a Llama-family decoder stack on CPU in one C call (layers/decoder_stack.c) for steps whose queries are
all short (decodes, speculative verification): the same kernels, order and rounding as the layer-by-layer
Python code, minus its per-layer glue, which costs as much as the matmuls in a single-stream decode step of a
small model.

Each linear layer runs the float panel kernel; for int8 weight-only and w8a8 layers, the int8 kernel
(quantization/qlinear.c) with the layer's scales; for ggml block weights (a GGUF served natively, int4), the
block kernel (quantization/ggml.c) over the layer's parts: the call its Python `apply` makes for decode-sized
rows.

`CpuStack.build` returns None where the stack does not apply as a whole (fp8/fp4 or unpacked linears, an
8-bit KV cache, per-layer sliding windows, row-parallel biases, a non-SiLU MLP, a family whose layers differ
(Gemma 3: `cpu_stack_unsupported`), no C compiler; `unavailable` says which);
A linear layer with LoRA adapters (layers/lora.py, float32 models) hands the C side its slot tensors, and a step's
adapter rows add their own slot's x A^T B^T there (`lora_slot` per token); a bfloat16 model's adapter steps
go layer by layer.

`run` returns None for a step it does not take (a prefill, hooks on the layers, bfloat16 adapter rows, more rows
than some layer's measured matmul plan gives the panel kernel); the caller then runs the Python layers.
`status` is the engine's kernels-report line for it.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

import torch

from tokenmill.distributed import pp_size, tp_size
from tokenmill.layers import batch_invariant, cpu_fused, cpu_linear, matmul_plan
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.attention import cpu_kernels
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.layers.attention.cpu import PagedAttentionBackend, step_plan
from tokenmill.layers.cpu_build import VEC_HEADER, load_library
from tokenmill.layers.linear import UnquantizedLinearMethod
from tokenmill.layers.lora import LoRALayer
from tokenmill.layers.quantization import ggml
from tokenmill.layers.quantization import kernels as qkernels
from tokenmill.layers.quantization.int8 import Int8LinearMethod

_SOURCE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "layers", "decoder_stack.c")
vp, i64 = ctypes.c_void_p, ctypes.c_int64


LINEAR_PANEL, LINEAR_INT8, LINEAR_BLOCKS = 0, 1, 2  # decoder_stack.c's linear kinds


class _LoRA(ctypes.Structure):
    _fields_ = [("a", vp), ("b", vp * 3), ("part_n", i64 * 3), ("present", vp), ("parts", ctypes.c_int32),
                ("rank", ctypes.c_int32), ("max_loras", ctypes.c_int32)]


class _Linear(ctypes.Structure):
    _fields_ = [("fn", vp), ("w", vp), ("bias", vp), ("scale", vp), ("N", i64), ("K", i64),
                ("kind", ctypes.c_int32), ("qmax", ctypes.c_int32), ("lora", vp)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", vp), ("norm2", vp), ("q_norm", vp), ("k_norm", vp), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("kv_cache", vp)]


class _Stack(ctypes.Structure):
    _fields_ = [("num_layers", i64), ("H", i64), ("Hq", i64), ("Hkv", i64), ("D", i64), ("I", i64),
                ("block_size", i64), ("num_slots", i64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("bf16", ctypes.c_int), ("cos_t", vp), ("sin_t", vp), ("final_norm", vp), ("norm", vp),
                ("silu", vp), ("rope", vp), ("attn", vp), ("write_kv", vp), ("layers", ctypes.POINTER(_Layer))]


class _Step(ctypes.Structure):
    _fields_ = [("M", i64), ("bt_stride", i64), ("positions", vp), ("slots", vp), ("block_table", vp),
                ("req_of", vp), ("kv_start", vp), ("kv_end", vp), ("lora_slot", vp)]


def _load():
    lib = load_library("decoder_stack", [_SOURCE, VEC_HEADER])
    if lib is not None and not getattr(lib, "_typed", False):
        lib.decoder_stack_scratch.argtypes = [ctypes.POINTER(_Stack), i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]
        lib.decoder_stack_scratch.restype = None
        lib.decoder_stack_run.argtypes = [ctypes.POINTER(_Stack), ctypes.POINTER(_Step), vp, vp, vp, vp, ctypes.c_int]
        lib.decoder_stack_run.restype = ctypes.c_int
        lib._typed = True
    return lib


def available() -> bool:
    return _load() is not None


def _addr(fn) -> int:
    return ctypes.cast(fn, vp).value


class CpuStack:
    def __init__(self, model, kv_caches: list[torch.Tensor], lib, window: Optional[int]) -> None:
        cfg, first = model.config, model.layers[0]
        attn, dtype = first.self_attn, model.dtype
        self.lib, self.model, self.window = lib, model, window
        self.kv_caches = kv_caches  # kept alive: the C side points into them
        self.group, self.dtype = attn.num_heads // attn.num_kv_heads, dtype
        self._keep = []  # float32 biases and LoRA descriptions the C side points at
        loras = [_lora_layer(lin) for layer in model.layers for lin in _linears(layer)]
        # the step's token -> adapter slot (one LoRABatch shared by the model's LoRA layers), None without LoRA
        self.lora_batch = next((lora.batch for lora in loras if lora is not None), None)

        def lin(layer) -> _Linear:
            bias = None
            if layer.bias is not None:
                bias = layer.bias.detach().float().contiguous()
                self._keep.append(bias)
            bias = bias.data_ptr() if bias is not None else None
            lora = self._lora(_lora_layer(layer))
            method = layer.quant_method
            blocks = _block_linear(layer)
            if blocks is not None:  # w: the gg_part_t array, qmax: its length
                return _Linear(_addr(blocks.kernel(dtype)), ctypes.addressof(blocks.c_parts), bias, None,
                               blocks.N, blocks.K, LINEAR_BLOCKS, len(blocks.c_parts), lora)
            if isinstance(method, Int8LinearMethod):
                return _Linear(_addr(qkernels.load().int8_linear_iq), layer.weight.data_ptr(), bias,
                               layer.weight_row_scale.data_ptr(), layer.out_features, layer.in_features,
                               LINEAR_INT8, method.act_qmax, lora)
            p = layer.packed_weight
            return _Linear(_addr(p.kernel), p.ptr, bias, None, p.out_features, p.in_features, LINEAR_PANEL, 0, lora)

        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        layers = []
        for layer, kv in zip(model.layers, kv_caches):
            a = layer.self_attn
            layers.append(_Layer(ptr(layer.input_layernorm.weight), ptr(layer.post_attention_layernorm.weight),
                                 ptr(a.q_norm.weight) if a.qk_norm else None,
                                 ptr(a.k_norm.weight) if a.qk_norm else None,
                                 lin(a.qkv_proj), lin(a.o_proj), lin(layer.mlp.gate_up_proj),
                                 lin(layer.mlp.down_proj), kv.data_ptr()))
        self._layers = (_Layer * len(layers))(*layers)
        kv = kv_caches[0]
        rot = attn.rotary
        self.stack = _Stack(
            len(layers), cfg.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            first.mlp.down_proj.in_features, kv.shape[3], kv.shape[2] * kv.shape[3], first.input_layernorm.eps,
            attn.scale, int(dtype == torch.bfloat16), rot.cos.data_ptr(), rot.sin.data_ptr(),
            model.norm.weight.data_ptr(), _addr(cpu_fused.kernel("add_rms_norm", dtype)),
            _addr(cpu_fused.kernel("silu_mul", dtype)), _addr(cpu_fused.kernel("rope", dtype)),
            _addr(cpu_kernels.kernel(dtype)), _addr(cpu_kernels.load().write_kv), self._layers)
        self._scratch: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        # Steps with more rows than this go layer by layer: some layer runs them faster through torch
        # (matmul_plan.py), or an int8 layer widens its weight for MKL there; the stack only knows the kernels.
        lins = [lin for layer in model.layers for lin in _linears(layer)]
        int8 = [lin.quant_method.kernel_rows for lin in lins if isinstance(lin.quant_method, Int8LinearMethod)]
        blocks = [_block_linear(lin).row_limit(dtype) for lin in lins if _block_linear(lin) is not None]
        plans = [lin.packed_weight.plan for lin in lins
                 if type(lin.quant_method) is UnquantizedLinearMethod]
        self.max_rows = min([matmul_plan.panel_row_limit(plans)] + int8 + blocks)

    def _lora(self, lora: Optional[LoRALayer]) -> Optional[int]:
        """The address of a C description of a layer's adapter slots (kept alive here), or None."""
        if lora is None or self.dtype != torch.float32:
            return None
        parts = len(lora.b)
        desc = _LoRA(lora.a.data_ptr(), (vp * 3)(*[b.data_ptr() for b in lora.b]),
                     (i64 * 3)(*lora.part_sizes), lora.present.data_ptr(), parts, lora.rank, lora.a.shape[0])
        self._keep.append(desc)
        return ctypes.addressof(desc)

    @classmethod
    def build(cls, model, kv_caches: list[torch.Tensor]) -> Optional["CpuStack"]:
        if unavailable(model, kv_caches) is not None:
            return None
        return cls(model, kv_caches, _load(), model.layers[0].self_attn.window)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> Optional[torch.Tensor]:
        """The final-normed hidden states [T, H] of the step, or None when this step is not the stack's."""
        if torch.is_grad_enabled() or _hooked(self.model):
            return None
        lora_slot = None
        if meta.adapters:  # LoRA rows: the C side applies float32 adapters only
            if self.lora_batch is None or self.dtype != torch.float32:
                return None
            lora_slot = self.lora_batch.slots.data_ptr()
        plan = step_plan(meta, self.window, self.group, True)
        if not (plan.dec_all and plan.use_kernel):
            return None
        pos, slots = meta.positions, meta.slot_mapping
        if (pos.dtype != torch.int64 or slots.dtype != torch.int64 or not pos.is_contiguous()
                or not slots.is_contiguous()):
            return None
        if input_ids.shape[0] > self.max_rows and not batch_invariant.enabled():
            return None
        x = self.model.embed(input_ids).contiguous()
        M = x.shape[0]
        out = torch.empty_like(x)
        act, f32 = self._scratch_for(M)
        bt = plan.dec_block_table
        step = _Step(M, bt.stride(0), pos.data_ptr(), slots.data_ptr(), bt.data_ptr(), plan.dec_rows.data_ptr(),
                     plan.dec_kv_start.data_ptr(), plan.dec_kv_end.data_ptr(), lora_slot)
        if self.lib.decoder_stack_run(ctypes.byref(self.stack), ctypes.byref(step), x.data_ptr(), out.data_ptr(),
                                      act.data_ptr(), f32.data_ptr() if f32 is not None else None,
                                      torch.get_num_threads()):
            raise IndexError(f"a KV slot is outside the cache ({self.stack.num_slots} slots per head)")
        return out

    def _scratch_for(self, M: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Scratch for M tokens: one buffer pair, grown as needed and reused (no allocation per step)."""
        act, f32 = i64(), i64()
        self.lib.decoder_stack_scratch(ctypes.byref(self.stack), M, ctypes.byref(act), ctypes.byref(f32))
        if self._scratch is None or self._scratch[0].numel() < act.value:
            self._scratch = (torch.empty(act.value, dtype=self.dtype),
                             torch.empty(f32.value, dtype=torch.float32) if f32.value else None)
        return self._scratch


def _block_linear(layer) -> Optional["ggml.BlockLinear"]:
    """The bound block kernel of a layer with ggml block weights (gguf_blocks, int4), else None."""
    return getattr(layer.quant_method, "block_linear", None)


def _lora_layer(linear) -> Optional[LoRALayer]:
    """The LoRA adapter slots hooked on a linear layer (layers/lora.py attach), or None."""
    return next((hook for hook in linear._forward_hooks.values() if isinstance(hook, LoRALayer)), None)


def _hooked(model) -> bool:
    return any(layer._forward_pre_hooks or layer._forward_hooks for layer in model.layers)


def _linears(layer) -> tuple:
    a, mlp = layer.self_attn, layer.mlp
    return a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj


def unavailable(model, kv_caches: list[torch.Tensor]) -> Optional[tuple[str, bool]]:
    """Why the stack cannot run `model` on these caches, or None if it can: (reason, fallback), fallback being
    True where the cause is a missing kernel or the packing budget (a slower path than this machine should
    take) rather than the model's own features."""
    family = getattr(model, "cpu_stack_unsupported", None)  # a layer structure decoder_stack.c does not have
    if family is not None:
        return family, False
    if tp_size() > 1 or pp_size() > 1:  # the C stack has no collectives between its layers
        return "tensor/pipeline parallel (no all-reduce or stage hand-off inside the C stack)", False
    if model.norm.weight.device.type != "cpu":
        return "not on CPU", False
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in model.layers):
        return "mixture-of-experts feed-forward layers", False
    if model.dtype not in cpu_kernels.DTYPES:
        return f"no C kernels for {model.dtype}", False
    lins = [lin for layer in model.layers for lin in _linears(layer)]
    libraries = {"skinny_linear": cpu_linear.available, "cpu_fused": cpu_fused.available,
                 "paged_attention": lambda: cpu_kernels.load() is not None, "decoder_stack": available}
    if any(isinstance(lin.quant_method, Int8LinearMethod) for lin in lins):
        libraries["qlinear"] = qkernels.available
    if any(_block_linear(lin) is not None for lin in lins):
        libraries["ggml"] = ggml.available
    missing = [name for name, ok in libraries.items() if not ok()]
    if missing:
        return f"C kernel libraries unavailable: {', '.join(missing)}", True
    feature = _model_mismatch(model, kv_caches)
    if feature is not None:
        return feature, False
    if any(type(lin.quant_method) is UnquantizedLinearMethod and getattr(lin, "packed_weight", None) is None
           for lin in lins):
        return "linear weights left unpacked (packed-weight budget exhausted)", True
    return None


def _model_mismatch(model, kv_caches: list[torch.Tensor]) -> Optional[str]:
    """The model feature (or cache layout) the stack does not implement, or None."""
    if not kv_caches or len(kv_caches) != len(model.layers):
        return "no KV cache per layer"
    if len({kv.data_ptr() for kv in kv_caches}) != len(kv_caches):  # the stack reads one block table for all
        return "layers share KV tensors (KV groups of different windows)"
    first = model.layers[0].self_attn
    if not isinstance(first.backend, PagedAttentionBackend) or first.backend.kernel is None:
        return f"attention backend {first.backend.name} has no paged C kernel"
    if len({layer.self_attn.window for layer in model.layers}) != 1:
        return "per-layer sliding windows"
    rot = first.rotary
    if rot.cos.dtype != torch.float32 or not rot.cos.is_contiguous() or not rot.sin.is_contiguous():
        return "rotary tables not float32 contiguous"
    for layer, kv in zip(model.layers, kv_caches):
        reason = _layer_mismatch(model, layer, kv, kv_caches[0])
        if reason is not None:
            return reason
    return None


def _layer_mismatch(model, layer, kv: torch.Tensor, kv0: torch.Tensor) -> Optional[str]:
    a, first, dtype = layer.self_attn, model.layers[0].self_attn, model.dtype
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([a.q_norm, a.k_norm] if a.qk_norm else [])
    if a.kv_quant is not None:
        return "8-bit KV cache"
    if a.backend is not first.backend or a.rotary is not first.rotary:
        return "layers differ in attention backend or rotary tables"
    if a.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
        return "biases on o_proj/down_proj"
    if getattr(layer.mlp, "act", silu_and_mul) is not silu_and_mul:
        return "an MLP activation other than SiLU"
    if (kv.dtype != dtype or not kv.is_contiguous() or kv.dim() != 5 or kv.shape[1] != a.num_kv_heads
            or kv.shape[4] != a.head_dim or kv.shape != kv0.shape):
        return "KV cache dtype or layout"
    other = [lin.quant_method for lin in _linears(layer) if _block_linear(lin) is None
             and not isinstance(lin.quant_method, (UnquantizedLinearMethod, Int8LinearMethod))]
    if other:
        return f"{type(other[0]).__name__} linear layers (the stack runs float, int8, w8a8 and ggml block ones)"
    if any(n.weight.dtype != dtype or n.eps != model.norm.eps for n in norms):
        return "norms differ in dtype or eps"
    return None


def status(model, kv_caches: list[torch.Tensor]) -> tuple[str, Optional[str]]:
    """The kernels report's entry: ("on", None), or ("off: <reason>", the reason where it is a fallback)."""
    if not getattr(model, "use_cpu_stack", False):
        return "off: turned off on the model (use_cpu_stack)", None
    if _hooked(model):
        return "off: forward hooks on the layers (a drafter reading hidden states)", None
    why = unavailable(model, kv_caches)
    if why is None:
        return "on", None
    reason, fallback = why
    return f"off: {reason}", reason if fallback else None
