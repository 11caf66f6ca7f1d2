"""Linear layers on ggml's quantized blocks (a GGUF file's bytes as they are), through ggml.c.

A weight [N, K] of one ggml type is a uint8 tensor [N, >= row_bytes] (rows possibly strided: a rank's slice of
a memory-mapped file). A merged layer (q|k|v, gate|up) is a list of `Part`s, each in its own type; part i's
outputs are the columns after those of parts < i. `bind(parts, K)` ties them to the kernels once per layer.

Routing by rows of x (BlockLinear.__call__):
- up to `max_rows` (decode, small batches): gg_linear, integer dot products on the blocks with the activations
  quantized to int8 per 32 values (per 256 for the K-quants; ggml.c says how). Its results for a row do not depend on the other rows,
  so batch-invariant mode sends every row count here.
- more (prefill): weight tiles of at most TILE_BYTES are dequantized (bfloat16 where the CPU has native bf16
  dot products and x is 16-bit, else float32) into a reused buffer and multiplied with torch (oneDNN/MKL) into
  the output's columns: no full-size float copy of the weight.
The row limits are the measured crossovers of the two (see MAX_ROWS_BF16's comment).
Without the C library (no compiler, TOKENMILL_CPU_KERNELS=0) the parts are dequantized with gguf-py and
F.linear runs: correct, slow, logged once.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from tokenmill.host import cpu_has_native_bf16
from tokenmill.layers import batch_invariant, matmul_plan
from tokenmill.layers.cpu_build import VEC_HEADER, load_library

logger = logging.getLogger("tokenmill")

SOURCE = os.path.join(os.path.dirname(__file__), "ggml.c")
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = (
    0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23, 30)
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
              Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_NL: "IQ4_NL",
              IQ4_XS: "IQ4_XS", BF16: "BF16"}
_BLOCKS = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22),
           Q5_1: (32, 24), Q8_0: (32, 34), IQ4_NL: (32, 18), Q2_K: (256, 84), Q3_K: (256, 110),
           Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), IQ4_XS: (256, 136)}
# Ours, not ggml's: rows repacked eight at a time (ggml.c's x8_lane says how), which `bind` makes where the CPU
# has the kernel (Q6_K: with VNNI only): the same bytes, 1.5-2x the decode speed (benchmarks/ggml_kernels.py).
# Id: 1000 + the type held.
REPACKABLE = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)
BASE_TYPE = {1000 + t: t for t in REPACKABLE}  # the ggml type an x8 layout holds
Q4_0X8, Q4_1X8, Q5_0X8, Q5_1X8, Q8_0X8, Q2_KX8, Q3_KX8, Q4_KX8, Q5_KX8, Q6_KX8, IQ4_XSX8 = BASE_TYPE
TYPE_NAMES.update({x8: TYPE_NAMES[t] + "x8" for x8, t in BASE_TYPE.items()})
_BLOCKS.update({x8: _BLOCKS[t] for x8, t in BASE_TYPE.items()})
FLOAT_TYPES = (F32, F16, BF16)
# Rows of x up to which the integer kernel beats dequantized tiles + torch's GEMM (the crossover), measured with
# `python benchmarks/ggml_kernels.py --crossover [--f32]` (N = K = 4096, 2 threads, AMD EPYC with AVX512_VNNI
# and AVX512_BF16, quiet machine, one sitting; ms integer / tiled):
#   bf16 x, bf16 tiles  M=8        M=16       M=24       M=32       M=48
#     Q4_0              1.11/2.54  2.23/3.12  3.31/3.73  4.52/4.27  6.77/5.45
#     Q4_1              1.26/2.92  2.35/3.51  3.66/4.23  4.74/4.75  7.20/6.01
#     Q5_0              1.26/2.56  2.43/3.18  3.64/3.75  4.87/4.37  7.39/5.57
#     Q8_0              1.40/2.74  2.75/3.35  4.16/3.98  5.50/4.59  9.36/5.85
#     IQ4_XS            1.24/2.81  2.48/3.42  3.70/4.01  4.93/4.59  7.46/5.75
#     Q2_K              1.14/2.91  2.28/3.61  3.52/4.26  4.65/4.86  6.07/5.48
#     Q3_K              0.96/2.81  1.93/3.37  2.88/3.98  3.82/4.63  5.76/5.73
#     Q4_K              0.93/2.86  1.93/3.45  2.81/4.07  3.79/4.69  6.17/5.76
#     Q5_K              0.98/3.08  1.94/3.62  2.96/4.23  3.94/4.79  5.87/5.92
#     Q6_K              1.07/2.88  2.01/3.47  3.03/4.10  4.29/4.67  6.34/5.83
#   float32 x, float32 tiles  M=48       M=64         M=96         M=128
#     Q4_0                    13.51/14.42  17.99/17.18  27.09/22.37  36.22/27.79
#     Q4_K                    11.30/14.59  15.18/17.47  22.60/22.79  30.21/28.01
#     Q6_K                    11.82/14.54  15.74/17.38  23.28/22.80  30.95/28.10
# A merged layer takes the smallest limit of its parts' types; the types not listed were not measured and take
# the default. bf16 x on a CPU without native bf16 takes the third table below.
MAX_ROWS_BF16 = 16
MAX_ROWS_F32 = 64
_MAX_ROWS_BF16 = {Q4_0: 24, Q4_1: 24, Q5_0: 24, IQ4_XS: 24, Q2_K: 32, Q3_K: 32, Q4_K: 32, Q5_K: 32, Q6_K: 32}
_MAX_ROWS_F32 = {Q4_0: 48, Q4_K: 96}
# The x8 layouts (Q4_0/Q4_1 repacked), measured the same way on an Intel Xeon with AVX-512 VNNI/BF16 (ms; bf16 with
# the 512-bit two-group kernel, f32 before it, which only makes the integer side faster):
#   bf16 x   M=32       M=64       M=96       M=128       f32 x  M=32        M=64         M=96         M=128
#     Q4_0   2.08/5.45  4.09/6.75  6.59/7.19  9.01/8.22          5.17/12.06  10.60/15.90  16.24/20.60  21.77/24.48
#     Q4_1                                                       5.17/13.36  10.71/16.12  16.23/26.05  21.53/26.84
# (the per-row Q4_0 kernel on that machine: bf16 M=32 5.58/5.21, f32 M=64 23.60/15.69)
# Q5_0/Q8_0/Q4_K x8, float32 x, on an AVX2-only AMD EPYC (2 threads, ms integer / tiled; the tiles are noisy there):
#     Q5_0   M=32 13.34/19.95  M=48 22.11/25.11  M=64 29.56/28.42  M=96 40.80/42.60
#     Q8_0   M=32 12.94/17.56  M=48 17.00/21.67  M=64 27.13/25.54  M=96 34.69/32.25
#     Q4_K   M=32 17.60/37.46  M=48 14.00/19.69  M=64 26.66/26.03  M=96 28.28/26.92
# Their bf16 crossovers were first set from the per-row kernels' (24; Q4_K 32) times the x8 kernels' speed-up
# (1.4-1.6x; Q4_K 1.3-1.5x), rounded down. On an AVX-512 BF16 AMD EPYC (2026-12-07, N=8960 K=1536, bf16 x, ms
# integer / tiled) they lie much higher, and the per-row Q6_K's lower:
#   Q4_Kx8  M=32 1.11/3.05  M=64 2.17/3.95  M=128 4.43/5.74  M=256 9.41/9.31   M=512 20.27/16.47
#   Q8_0x8  M=32 1.08/4.24  M=64 2.14/5.05  M=128 4.30/6.94  M=256 9.10/10.49  M=512 19.09/17.24
#   Q5_0x8  M=32 0.81/4.91  M=64 1.95/5.89  M=128 3.30/7.73  M=256 6.84/11.17  M=512 16.08/18.24
#   Q4_0x8  M=32 0.73/3.54  M=64 1.45/4.41  M=128 2.86/6.21  M=256 6.24/9.70   M=512 13.97/16.56
#   Q6_K    M=16 1.35/1.81  M=24 2.02/2.02  M=32 2.70/2.28  M=64 5.28/3.09
# which is why a GGUF layer's limit is measured on the CPU at hand (`bind(..., dtype=)`), these tables its prior.
_MAX_ROWS_BF16.update({Q4_0X8: 96, Q4_1X8: 96, Q5_0X8: 32, Q5_1X8: 32, Q8_0X8: 32, Q4_KX8: 40, Q5_KX8: 40,
                       Q6_KX8: 40, IQ4_XSX8: 32})
_MAX_ROWS_F32.update({Q4_0X8: 128, Q4_1X8: 128, Q5_0X8: 64, Q5_1X8: 64, Q8_0X8: 64, Q4_KX8: 64, Q5_KX8: 64,
                      Q6_KX8: 64, IQ4_XSX8: 64})
# bf16 x where the CPU lacks native bf16 (the tiles are float32, the integer kernel runs int8 activations: not
# the float32 row's two passes), AVX2-only AMD EPYC, N=8960 K=1536 (a 1.5B's MLP), 2 threads, ms integer / tiled:
#              M=64         M=128        M=192        M=256        M=512
#   Q4_0x8     6.92/31.73   14.89/38.45  20.71/57.14  33.01/57.73  58.50/88.84
#   Q4_1x8     6.30/18.94   13.60/29.67  19.88/38.44  27.15/48.39  53.99/91.03
#   Q5_0x8     6.86/19.71   14.55/32.74  21.72/40.94  28.37/49.65  56.69/88.62
#   Q5_1x8     6.92/20.79   13.75/30.59  20.86/39.74  29.01/50.42  59.58/92.05
#   Q8_0x8     9.10/20.27   17.99/30.62  26.64/39.95  34.42/52.55  69.02/96.14
#   Q4_Kx8    12.05/20.00   18.65/29.60  21.91/42.69  29.33/48.47  63.30/89.00
#   Q2_K      10.78/15.44   22.16/26.07  33.78/36.51  55.41/54.65 120.42/103.05
#   Q3_K      16.20/17.28   33.74/29.99  (M=96 24.73/23.69)
#   Q5_K      12.25/14.58   25.16/26.32  38.19/34.63
#   Q6_K      12.19/16.01   23.31/25.10  34.37/35.89  47.63/43.90  99.28/100.23
#   IQ4_XS    14.29/14.47   29.29/26.35  (IQ4_NL M=32 9.64/9.88, M=48 14.71/12.48)
# The x8 layouts win at every count measured (1.4-1.7x at 512): they take prefill too (a step's rows are at most
# --max-num-batched-tokens). So does Q6_K since ggml.c decodes its tiles for an x8-style kernel from 16 rows of x
# where it is not repacked at load (no VNNI; same EPYC, 2026-12-07, ms integer / tiled):
#   Q6_K      M=16 2.77/12.30  M=64 9.02/21.29  M=128 18.20/33.20  M=256 35.89/57.31  M=512 73.54/103.48
NO_ROW_LIMIT = 1 << 20  # more rows than any step holds
MAX_ROWS_INT8_F32_TILES = 32
# IQ4_XS x8 (added later, same EPYC, N=8960 K=1536, us per call integer x8 / per-row): M=1 680/1180, M=4
# 1990/2160, M=8 3690/3750, M=32 14090/14480: its gain is at decode, so it keeps the per-row type's crossover
_MAX_ROWS_INT8_F32_TILES = {Q2_K: 192, Q3_K: 64, Q5_K: 128, Q6_K: NO_ROW_LIMIT, IQ4_XS: 64, IQ4_NL: 32,
                            **{x8: NO_ROW_LIMIT for x8 in BASE_TYPE}, IQ4_XSX8: 64}
TILE_BYTES = 4 << 20  # a dequantized weight tile (L2/L3-sized, reused)
REPACK_CHUNK_BYTES = 16 << 20  # rows repacked to x8 at a time (then released: `repacked`)


def block_size(type_id: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    if type_id not in _BLOCKS:
        raise ValueError(f"unsupported ggml type {type_id}")
    return _BLOCKS[type_id]


def row_bytes(type_id: int, K: int) -> int:
    values, nbytes = block_size(type_id)
    if K % values:
        raise ValueError(f"K={K} is not a multiple of {TYPE_NAMES[type_id]}'s {values}-value blocks")
    return K // values * nbytes


# the linear kernels, one signature: int8 activations, float32 x's two passes, and both for batch-invariant mode
KERNEL_NAMES = ("gg_linear", "gg_linear_precise", "gg_linear_invariant", "gg_linear_precise_invariant")


class _CPart(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int32), ("pad", ctypes.c_int32), ("rows", ctypes.c_int64),
                ("row_stride", ctypes.c_int64), ("w", ctypes.c_void_p)]


def typed(lib):
    """Declare the library's signatures (once per loaded library)."""
    if lib is not None and not getattr(lib, "_typed", False):
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        for name in KERNEL_NAMES:
            getattr(lib, name).argtypes, getattr(lib, name).restype = [vp, i64, vp, i32, i64, i64, vp, vp, i32], None
        lib.gg_dequant_rows.argtypes = [i32, vp, i64, vp, i64, i64, vp, i32, i32]
        lib.gg_dequant_rows.restype = None
        lib.gg_isa.argtypes, lib.gg_isa.restype = [], ctypes.c_char_p
        lib.gg_repack_x8.argtypes, lib.gg_repack_x8.restype = [i32, vp, i64, i64, i64, vp, i32], i32
        lib._typed = True
    return lib


def load():
    """The ctypes library (or None where it cannot be built)."""
    return typed(load_library("ggml", [SOURCE, VEC_HEADER]))


def available() -> bool:
    return load() is not None


def isa(lib=None) -> str:
    """The integer path the library runs: avx512-vnni, avx-vnni, avx2 or scalar ("torch" without it)."""
    lib = lib or load()
    return lib.gg_isa().decode() if lib is not None else "torch"


class Part(NamedTuple):
    """One type's rows of a (merged) weight: data uint8 [rows, >= row_bytes], row stride data.stride(0)."""
    type: int
    data: torch.Tensor


def _check(part: Part, K: int) -> None:
    d = part.data
    if d.dtype != torch.uint8 or d.dim() != 2 or (d.shape[0] > 1 and d.stride(1) != 1):
        raise ValueError(f"a ggml part must be a uint8 [rows, bytes] tensor with contiguous rows, not "
                         f"{d.dtype} {tuple(d.shape)} strides {d.stride()}")
    if d.shape[1] < row_bytes(part.type, K):
        raise ValueError(f"{TYPE_NAMES[part.type]} rows of {d.shape[1]} bytes are too short for K={K}")


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _reference_dequantize(part: Part, K: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """gguf-py's dequantization (the torch path without the C library)."""
    import gguf.quants

    data = part.data if rows is None else part.data[rows.long()]
    raw = data[:, :row_bytes(part.type, K)].contiguous().numpy()
    out = gguf.quants.dequantize(raw, part.type)
    return torch.from_numpy(out.reshape(data.shape[0], K).astype("float32"))


def dequantize(part: Part, K: int, rows: Optional[torch.Tensor] = None, dtype=torch.float32,
               lib=None) -> torch.Tensor:
    """The rows (all, or those listed) of a part as float [R, K] in dtype."""
    _check(part, K)
    lib = lib or load()
    if lib is None:
        _warn_once("ggml kernels unavailable: dequantizing GGUF blocks with gguf-py (slow)")
        return _reference_dequantize(part, K, rows).to(dtype)
    idx = None if rows is None else rows.to(torch.int64).contiguous()
    R = part.data.shape[0] if idx is None else idx.numel()
    if idx is not None and R and (int(idx.min()) < 0 or int(idx.max()) >= part.data.shape[0]):
        raise IndexError(f"row index out of range for a part of {part.data.shape[0]} rows")
    bf16 = dtype == torch.bfloat16
    out = torch.empty(R, K, dtype=torch.bfloat16 if bf16 else torch.float32)
    lib.gg_dequant_rows(part.type, part.data.data_ptr(), part.data.stride(0),
                        None if idx is None else idx.data_ptr(), R, K, out.data_ptr(), int(bf16),
                        torch.get_num_threads())
    return out if out.dtype == dtype else out.to(dtype)


_tiles = threading.local()  # the prefill route's dequantized-tile buffer, per thread, grown and reused


def _tile_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    buf = getattr(_tiles, "buf", None)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        _tiles.buf = buf
    return buf


def _row_limit(parts: list[Part], table: dict[int, int], default: int) -> int:
    """A merged layer's row limit: the smallest of its parts' types' (those not in the table take the default)."""
    return min([table.get(p.type, default) for p in parts], default=default)


class BlockLinear:
    """y = x @ W^T (+ bias) over ggml parts; built once per layer by `bind`. max_rows: the most rows of x the
    integer kernel serves (the one-call decoder stack reads it); c_parts: the gg_part_t array it passes."""

    def __init__(self, parts: list[Part], K: int, lib=None, max_rows: Optional[int] = None) -> None:
        for p in parts:
            _check(p, K)
        self.parts, self.K = list(parts), K
        self.N = sum(p.data.shape[0] for p in parts)
        self._tile_bf16 = cpu_has_native_bf16()
        # max_rows: for 16-bit x (against bf16 tiles where the CPU has native bf16, else float32 ones); float32 x
        # (two integer passes) has its own crossover
        f32 = _row_limit(parts, _MAX_ROWS_F32, MAX_ROWS_F32)
        bf16 = (_row_limit(parts, _MAX_ROWS_BF16, MAX_ROWS_BF16) if self._tile_bf16
                else _row_limit(parts, _MAX_ROWS_INT8_F32_TILES, MAX_ROWS_INT8_F32_TILES))
        self.max_rows = max_rows if max_rows is not None else bf16
        self._max_rows_f32 = max_rows if max_rows is not None else f32
        self.lib = lib or load()
        self.c_parts = (_CPart * len(parts))(*[
            _CPart(p.type, 0, p.data.shape[0], p.data.stride(0), p.data.data_ptr()) for p in parts])
        self._addr = ctypes.addressof(self.c_parts)

    def row_limit(self, dtype: torch.dtype) -> int:
        """The most rows of x in `dtype` the integer kernel serves (more go to the tiles)."""
        return self._max_rows_f32 if dtype == torch.float32 else self.max_rows

    def kernel(self, dtype: torch.dtype):
        """The C kernel for x in `dtype`: float32 models take the ~16-bit activations of gg_linear_precise; in
        batch-invariant mode the variant that never picks a kernel by the number of rows."""
        name = "gg_linear_precise" if dtype == torch.float32 else "gg_linear"
        return getattr(self.lib, name + "_invariant" if batch_invariant.enabled() else name)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor], float_out: bool = False) -> torch.Tensor:
        """y in x's dtype, or float32 with float_out (logits: the kernels compute in float32, and rounding them
        to bf16 turns near ties into ties)."""
        K, N = self.K, self.N
        rows = x.numel() // K
        if self.lib is None:
            y = self._torch(x, bias)
        elif rows > self.row_limit(x.dtype) and not batch_invariant.enabled():
            y = self._tiled(x, bias)
        else:
            x2 = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
            b = bias if bias is None or bias.dtype == torch.float32 else bias.float().contiguous()
            y = torch.empty(x.shape[:-1] + (N,), dtype=torch.float32)
            self.kernel(x.dtype)(x2.data_ptr(), rows, self._addr, len(self.parts), N, K,
                                 None if b is None else b.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y.float() if float_out else y.to(x.dtype)

    def _tiled(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Prefill rows: dequantized weight tiles times x with torch's GEMM, tile by tile into y's columns."""
        K, N = self.K, self.N
        bf16 = self._tile_bf16 and x.dtype in (torch.bfloat16, torch.float16)
        dt = torch.bfloat16 if bf16 else torch.float32
        x2 = x.reshape(-1, K).to(dt).contiguous()
        y = torch.empty(x2.shape[0], N, dtype=dt)
        step = max(8, TILE_BYTES // (K * x2.element_size()) // 8 * 8)  # whole groups of an x8 part
        buf = _tile_buffer(min(step, max(p.data.shape[0] for p in self.parts)) * K, dt)
        col, nt = 0, torch.get_num_threads()
        for p in self.parts:
            rows, stride, ptr = p.data.shape[0], p.data.stride(0), p.data.data_ptr()
            for r0 in range(0, rows, step):
                n = min(step, rows - r0)
                w = buf[:n * K].view(n, K)
                self.lib.gg_dequant_rows(p.type, ptr + r0 * stride, stride, None, n, K, w.data_ptr(), int(bf16), nt)
                torch.mm(x2, w.t(), out=y[:, col + r0:col + r0 + n])
            col += rows
        if bias is not None:
            y += bias.to(dt)
        return y.reshape(*x.shape[:-1], N)

    def _torch(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        _warn_once("ggml kernels unavailable: GGUF block layers run as dequantized float weights (slow)")
        w = torch.cat([_reference_dequantize(p, self.K, None) for p in self.parts])
        return F.linear(x.float(), w, None if bias is None else bias.float())


def repacked(part: Part, K: int, lib=None, release: Optional[Callable[[torch.Tensor], object]] = None) -> Part:
    """A part of a REPACKABLE type as a new Part in the x8 layout (a copy: the part is left as it is), where the
    library has the kernel and the rows come in whole groups of 8; any other part as it is. release: called on
    each run of the part's rows (REPACK_CHUNK_BYTES) once copied, so that the source and the copy are not both
    resident in full (gguf_blocks pages a mapped file's rows out: a tied 152k-row embedding is ~140 MB).
    TOKENMILL_GGML_REPACK=0 turns it off (the per-row kernel, for comparisons)."""
    lib = lib or load()
    rows = part.data.shape[0]
    if (part.type not in REPACKABLE or lib is None or rows % 8 or rows == 0
            or os.environ.get("TOKENMILL_GGML_REPACK", "1") == "0"):
        return part
    _check(part, K)
    out = torch.empty(rows, row_bytes(part.type, K), dtype=torch.uint8)
    step = max(8, REPACK_CHUNK_BYTES // out.shape[1] // 8 * 8)  # whole groups of 8 rows
    t = -1
    for r0 in range(0, rows, step):
        src = part.data[r0:r0 + step]
        t = lib.gg_repack_x8(part.type, src.data_ptr(), src.stride(0), src.shape[0], K, out[r0:].data_ptr(),
                             torch.get_num_threads())
        if t < 0:  # the type or shape has no x8 kernel in this build: the same for every run of rows
            return part
        if release is not None:
            release(src)
    return Part(t, out)


def unpacked(part: Part, K: int) -> Part:
    """An x8 part back as the rows of the ggml type it holds (a copy; ggml.c's x8_lane undone with torch views, an
    independent check of the C repack); any other part as it is."""
    if part.type not in BASE_TYPE:
        return part
    base = BASE_TYPE[part.type]
    values, nbytes = block_size(base)
    heads = 4 if base in (Q4_1, Q5_1, Q4_K, Q5_K) else 2  # a block's d (and m or dmin) bytes
    nb, rows = K // values, part.data.shape[0]
    records = part.data[:, :row_bytes(base, K)].reshape(rows // 8, nb, 8 * nbytes)

    def lanes(start: int, chunks: int, width: int) -> torch.Tensor:
        """[rows, nb, chunks * width]: chunk c's bytes width*i.. of lane i, for row 8g + i"""
        piece = records[..., start:start + 8 * chunks * width].reshape(rows // 8, nb, chunks, 8, width)
        return piece.permute(0, 3, 1, 2, 4).reshape(rows, nb, chunks * width)

    as_they_lie = {  # the block's pieces in its order, each (start, chunks, width) as the record holds it
        Q6_K: [(16 + 128, 48, 4), (16, 4, 4), (0, 1, 2)],  # ql and qh, scales, d
        IQ4_XS: [(0, 1, 2), (48, 1, 2), (16, 1, 4), (64, 32, 4)],  # d, scales_h, scales_l, qs
        Q3_K: [(112, 8, 4), (368, 16, 4), (16, 3, 4), (0, 1, 2)],  # hmask, qs, scales, d
        Q2_K: [(32, 4, 4), (160, 16, 4), (0, 1, 2), (16, 1, 2)]}  # scales, qs, d, dmin
    if base in as_they_lie:
        pieces = [lanes(*piece) for piece in as_they_lie[base]]
        return Part(base, torch.cat(pieces, dim=-1).reshape(rows, nb * nbytes).contiguous())
    pieces, at = [lanes(0, heads // 2, 2)], 8 * heads
    if base in (Q4_K, Q5_K):  # byte s of lo / t of hi (per row): sub-block s's scale and min, low 4 / high 2 bits
        lo, hi = lanes(32, 8, 1).to(torch.int64), lanes(96, 4, 1).to(torch.int64).repeat(1, 1, 2)
        shift = 2 * (torch.arange(8) // 4)
        sc = (lo & 15) | ((hi >> shift) & 3) << 4
        mn = (lo >> 4) | ((hi >> (4 + shift)) & 3) << 4
        packed = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                            (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], dim=-1)  # ggml's 12 bytes
        qh = [lanes(128, 8, 4)] if base == Q5_K else []  # Q5_K's qh between the scales and the nibbles
        pieces += [packed.to(torch.uint8), *qh, lanes(128 + 256 * len(qh), 32, 4)]
        return Part(base, torch.cat(pieces, dim=-1).reshape(rows, nb * nbytes).contiguous())
    if base in (Q5_0, Q5_1):  # byte k of a lane: bit c is the fifth bit of value 4c + k
        bits = (lanes(at, 1, 4).to(torch.int64).unsqueeze(-1) >> torch.arange(8)) & 1
        qh = (bits.transpose(-1, -2).reshape(rows, nb, 32) << torch.arange(32)).sum(-1, keepdim=True)
        pieces.append(((qh >> (8 * torch.arange(4))) & 255).to(torch.uint8))
        at += 32
    pieces.append(lanes(at, 8 if base == Q8_0 else 4, 4))
    return Part(base, torch.cat(pieces, dim=-1).reshape(rows, nb * nbytes).contiguous())


def bind(parts: list[Part], K: int, lib=None, repack: bool = True, dtype: Optional[torch.dtype] = None,
         release: Optional[Callable[[torch.Tensor], object]] = None) -> BlockLinear:
    """The bound linear over these parts (their tensors must outlive it: it keeps them). repack: REPACKABLE parts
    run from x8 copies (`repacked`, which hands the rows it copied to release; the caller drops its own tensor if
    nothing else reads it). dtype: the dtype x
    will have, whose row limit (integer kernel up to it, tiles above) is then measured on this CPU
    (matmul_plan.block_row_limit, the tables the prior); without it the tables' limits hold."""
    if repack:
        parts = [repacked(p, K, lib, release) for p in parts]
    layer = BlockLinear(parts, K, lib)
    if dtype is None or layer.lib is None or batch_invariant.enabled():
        return layer
    int_only, tiles_only = BlockLinear(parts, K, lib, max_rows=NO_ROW_LIMIT), BlockLinear(parts, K, lib, max_rows=0)
    key = f"ggml {'+'.join(TYPE_NAMES[p.type] for p in parts)} {layer.N}x{K} {str(dtype).removeprefix('torch.')} " \
          f"t{torch.get_num_threads()}"
    limit = matmul_plan.block_row_limit(
        key, layer.row_limit(dtype), 2.0 * layer.N * K, lambda x: int_only(x, None), lambda x: tiles_only(x, None),
        lambda rows: torch.randn(rows, K).to(dtype))
    return BlockLinear(parts, K, lib, max_rows=limit)
