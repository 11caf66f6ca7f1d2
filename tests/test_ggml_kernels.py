"""The ggml block kernels (layers/quantization/ggml.c via ggml.py) against gguf-py's reference dequantization.

Each C path is tested on this machine: the library as the engine builds it (-march=native: AVX-512 VNNI here,
AVX2 on AVX2-only CI machines), and more builds of the same source with -march=x86-64-v3 (AVX2/FMA/F16C,
no AVX-512: vpmaddubsw + vpmaddwd, the byte-shuffle bit expansion), -march=x86-64 (SSE2 only: the scalar
decoders and dot products, fp16 converted in software) and, where the CPU has avx_vnni, -march=alderlake
(256-bit VNNI without AVX-512: the Q6_K x8 kernel's 256-bit form). Where TOKENMILL_SIMDE_DIR names a checkout of SIMDe
(github.com/simd-everywhere/simde; header-only, not a dependency), a fourth build runs the AVX-512 VNNI paths on
any AVX2 CPU: the source's __AVX512*__ tests are renamed to macros the build defines, and SIMDe's portable
_mm512_*/VNNI functions stand in for the instructions (AVX512_BF16 stays off: SIMDe lacks it).

Tolerance (derived, not fitted). gg_linear quantizes each block j of a row of x to int8 with scale
dx_j = max|x|/127, rounding to nearest, so each activation moves by at most dx_j / 2; the blocks are 32 values
for the 32-value weight types and 256 for the K-quants (one activation scale per super-block, as llama.cpp's
Q8_K); the integer dot products are exact, so the activation rounding contributes at most
    E_act = sum_j (dx_j / 2) * sum_{i in block j} |W_i|
to an output (W the reference dequantized weight row). The rest is float rounding: the per-block scale products
and the sums over K/32 blocks, of terms that the offset/min decomposition can make as large as the row's
largest weight times |x_i| each: at most a few dozen roundings of relative 2^-24 on
sum_i |x_i| (|W_i| + max|W|), which E_float = 2^-16 * sum_i |x_i| (|W_i| + max|W|) bounds with ample room.
Assert |y - x @ W^T| <= E_act + E_float elementwise (the kernel's error is typically 5-15% of E_act).
gg_linear_precise (float32 x) also quantizes each block's residual r = x - dx q (|r| <= dx/2, so its scale
dr <= dx/254, up to the float rounding of r) and adds its exact integer dot: E_precise = E_act / 254 (1 + 2^-10).
Rows above max_rows take dequantized tiles + torch's GEMM: with float32 x exact weights in float32, so only
E_float applies; with bf16 x (bf16 tiles where the CPU has native bf16) the inputs, the weights and the
output each round to bf16 (relative 2^-9): E_bf16 = 2^-7 * |x| @ |W|^T + 2^-8 |y| bounds it.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess

import numpy as np
import pytest
import torch

gguf_quants = pytest.importorskip("gguf.quants")

from tokenmill.layers.quantization import ggml  # noqa: E402

QUANTIZED = [ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0, ggml.Q2_K, ggml.Q3_K, ggml.Q4_K, ggml.Q5_K,
             ggml.Q6_K, ggml.IQ4_NL, ggml.IQ4_XS]
ALL_TYPES = QUANTIZED + [ggml.F32, ggml.F16, ggml.BF16]
QUANTIZABLE = {ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0}  # gguf-py can make these from floats
SCALES = {ggml.Q4_0: [0], ggml.Q4_1: [0, 2], ggml.Q5_0: [0], ggml.Q5_1: [0, 2], ggml.Q8_0: [0],
          ggml.IQ4_NL: [0], ggml.Q2_K: [80, 82], ggml.Q3_K: [108], ggml.Q4_K: [0, 2], ggml.Q5_K: [0, 2],
          ggml.Q6_K: [208], ggml.IQ4_XS: [0]}  # byte offsets of each block's fp16 scales
FLOATS = {ggml.F32: torch.float32, ggml.F16: torch.float16, ggml.BF16: torch.bfloat16}
MAX_ROWS = 32  # the tests' BlockLinear routes M <= 32 to gg_linear, above to the tiles


def blocks(type_id: int, N: int, K: int, seed: int = 0, pad: int = 0) -> torch.Tensor:
    """uint8 [N, row_bytes] of valid blocks (a view with row stride row_bytes + pad when pad > 0)."""
    rng = np.random.default_rng(seed + 1000 * type_id)
    if type_id in FLOATS:
        raw = torch.from_numpy(rng.standard_normal((N, K)).astype(np.float32)).to(FLOATS[type_id])
        raw = raw.view(torch.uint8).reshape(N, -1)
    elif type_id in QUANTIZABLE:
        w = (rng.standard_normal((N, K)) * 0.1).astype(np.float32)
        raw = torch.from_numpy(gguf_quants.quantize(w, type_id).reshape(N, -1))
    else:
        values, nbytes = ggml.block_size(type_id)
        b = rng.integers(0, 256, size=(N, K // values, nbytes), dtype=np.uint8)
        for o in SCALES[type_id]:
            b[..., o:o + 2] = (rng.uniform(-0.05, 0.05, (N, K // values)).astype(np.float16)
                               .view(np.uint8).reshape(N, K // values, 2))
        raw = torch.from_numpy(b.reshape(N, -1))
    if pad:
        wide = torch.full((N, raw.shape[1] + pad), 0xA5, dtype=torch.uint8)  # junk the kernel must not read
        wide[:, :raw.shape[1]] = raw
        raw = wide[:, :raw.shape[1]]
    return raw


def reference(part: ggml.Part, K: int) -> torch.Tensor:
    raw = part.data.contiguous().numpy()
    return torch.from_numpy(gguf_quants.dequantize(raw, part.type).reshape(raw.shape[0], K).astype(np.float32))


def act_block(type_id: int) -> int:
    """The activation block the integer kernel quantizes x in for a weight type (module docstring)."""
    return 256 if ggml.block_size(type_id)[0] == 256 else 32


def act_bound(x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, precise: bool = False) -> torch.Tensor:
    """E_act (or E_precise) + E_float of the module docstring, [M, N]; blocks [N]: each output column's
    activation block (32 or 256)."""
    x, w = x.double(), w.double()
    M, K = x.shape
    e_act = torch.zeros(M, w.shape[0], dtype=torch.float64)
    for b in blocks.unique().tolist():
        dx = x.reshape(M, K // b, b).abs().amax(-1) / 127                                # [M, K/b]
        if precise:
            dx = dx / 254 * (1 + 2.0 ** -10)
        wabs = w.abs().reshape(w.shape[0], K // b, b).sum(-1)                              # [N, K/b]
        e_act = torch.where(blocks == b, (dx / 2) @ wabs.t(), e_act)
    e_float = 2.0 ** -16 * (x.abs() @ (w.abs() + w.abs().amax(1, keepdim=True)).t())
    return e_act + e_float


def column_blocks(*parts: ggml.Part) -> torch.Tensor:
    return torch.cat([torch.full((p.data.shape[0],), act_block(p.type)) for p in parts])


def kernel_call(layer: ggml.BlockLinear, fn, x: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """y from one of the C kernels (gg_linear, gg_linear_precise) called directly on float32 x (threads: torch's
    count unless given; one thread runs the columns in tiles of 16, the 512-bit x8 kernels' two groups)."""
    y = torch.empty(x.shape[0], layer.N)
    fn(x.data_ptr(), x.shape[0], ctypes.addressof(layer.c_parts), len(layer.parts), layer.N, layer.K, None,
       y.data_ptr(), threads or torch.get_num_threads())
    return y


def check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, blocks: torch.Tensor, bias=None,
          route: str = "int") -> None:
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    xa, wa = x.double().abs(), w.double().abs()
    if route in ("int", "precise"):
        bound = act_bound(x.float(), w, blocks, precise=route == "precise")
        if bias is not None:
            bound = bound + 2.0 ** -23 * bias.double().abs()
    elif x.dtype == torch.float32:
        bound = 2.0 ** -16 * (xa @ (wa + wa.amax(1, keepdim=True)).t())
    else:
        bound = 2.0 ** -7 * (xa @ wa.t()) + 2.0 ** -8 * ref.abs()
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.abs()
    err = (y.double() - ref).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the derived bound ({route} route)"


def check_routes(layer: ggml.BlockLinear, lib, w: torch.Tensor, cols: torch.Tensor, row_counts) -> None:
    """Each M: up to MAX_ROWS both C kernels and BlockLinear (float32 x: the precise kernel), above the tiles."""
    for M in row_counts:
        x = torch.randn(M, layer.K, generator=torch.Generator().manual_seed(M))
        if M > MAX_ROWS:
            check(layer(x, None), x, w, cols, route="tiles")
            continue
        for threads in (1, 0):
            check(kernel_call(layer, lib.gg_linear, x, threads), x, w, cols, route="int")
            check(kernel_call(layer, lib.gg_linear_precise, x, threads), x, w, cols, route="precise")
        check(layer(x, None), x, w, cols, route="precise")


# -- the builds under test --------------------------------------------------------------------------------
def _variant(march: str, tmp_dir) -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C compiler")
    out = tmp_dir / f"ggml-{march}.so"
    cmd = [cc, "-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-o", str(out), ggml.SOURCE,
           "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return ggml.typed(ctypes.CDLL(str(out)))


def _avx512_emulated(tmp_dir) -> ctypes.CDLL:
    """ggml.c's AVX-512 VNNI/BW/VL paths on an AVX2 CPU, SIMDe emulating the 512-bit and VNNI instructions."""
    simde, cc = os.environ.get("TOKENMILL_SIMDE_DIR"), shutil.which("cc") or shutil.which("gcc")
    if not simde or cc is None or platform.machine() not in ("x86_64", "AMD64") or " avx2" not in _cpu_flags():
        pytest.skip("set TOKENMILL_SIMDE_DIR to a SIMDe checkout (needs an AVX2 CPU and a C compiler)")
    with open(ggml.SOURCE) as f:
        src = f.read().replace("__AVX512", "EMU_AVX512")
    head, tail = src.split("#include <immintrin.h>\n#endif\n", 1)
    emulated = tmp_dir / "ggml_emulated.c"
    emulated.write_text(head + "#include <immintrin.h>\n#endif\n#define SIMDE_ENABLE_NATIVE_ALIASES\n"
                        "#include <simde/x86/avx512.h>\n" + tail)
    out = tmp_dir / "ggml-avx512-emulated.so"
    defines = [f"-DEMU_AVX512{f}__" for f in ("F", "BW", "VL", "VNNI")]
    cmd = [cc, "-O1", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", f"-I{simde}",
           f"-I{os.path.dirname(ggml.SOURCE)}", *defines, "-o", str(out), str(emulated), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return ggml.typed(ctypes.CDLL(str(out)))


def _cpu_flags() -> str:
    with open("/proc/cpuinfo") as f:
        return f.read()


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64", "alderlake", "avx512-emulated"])
def lib(request, tmp_path_factory):
    if request.param == "native":
        native = ggml.load()
        if native is None:
            pytest.skip("ggml library unavailable")
        return native
    if request.param == "avx512-emulated":
        built = _avx512_emulated(tmp_path_factory.mktemp("ggml"))
        assert ggml.isa(built) == "avx512-vnni"
        return built
    if request.param == "alderlake" and " avx_vnni" not in _cpu_flags():
        pytest.skip("the 256-bit AVX-VNNI build needs a CPU with avx_vnni")
    built = _variant(request.param, tmp_path_factory.mktemp("ggml"))
    assert ggml.isa(built) == {"x86-64-v3": "avx2", "x86-64": "scalar", "alderlake": "avx-vnni"}[request.param]
    return built


def test_native_build_uses_the_best_path():
    flags = _cpu_flags()
    expected = "avx512-vnni" if " avx512_vnni" in flags and " avx512vl" in flags else (
        "avx-vnni" if " avx_vnni" in flags else "avx2" if " avx2" in flags else "scalar")
    assert ggml.isa() == expected


# -- correctness ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("type_id", ALL_TYPES, ids=lambda t: ggml.TYPE_NAMES[t])
def test_linear_matches_reference(lib, type_id):
    """Every type, both routes (M <= 32: integer kernel, Q6_K's tiles regrouped from 16 rows where it is not
    repacked at load; 40 and 300: tiles), strided rows; K = 512 and, for 32-value blocks, K = 288 (a tail of
    blocks after the last 256 values)."""
    Ks = [512] if ggml.block_size(type_id)[0] == 256 else [512, 288]
    for K in Ks:
        part = ggml.Part(type_id, blocks(type_id, 19, K, pad=5))
        w = reference(part, K)
        layer = ggml.BlockLinear([part], K, lib=lib, max_rows=MAX_ROWS)
        check_routes(layer, lib, w, column_blocks(part), (1, 3, 8, 20, 40, 300))


def test_merged_parts_bias_and_shapes(lib):
    """q|k|v-like merged parts of different types, with a bias, x of shape [2, T, K]."""
    K = 512
    types = [ggml.Q4_K, ggml.Q6_K, ggml.Q8_0, ggml.F16, ggml.Q5_0]
    parts = [ggml.Part(t, blocks(t, n, K, seed=n)) for t, n in zip(types, (7, 5, 3, 4, 9))]
    w = torch.cat([reference(p, K) for p in parts])
    layer = ggml.BlockLinear(parts, K, lib=lib, max_rows=MAX_ROWS)
    assert layer.N == 28 and len(layer.c_parts) == 5
    bias = torch.randn(layer.N)
    for T in (1, 4, 150):
        x = torch.randn(2, T, K)
        y = layer(x, bias)
        assert y.shape == (2, T, layer.N) and y.dtype == torch.float32
        check(y.reshape(-1, layer.N), x.reshape(-1, K), w, column_blocks(*parts), bias,
              route="int" if 2 * T <= MAX_ROWS else "tiles")


@pytest.mark.parametrize("type_id", [ggml.Q4_0, ggml.Q4_K, ggml.Q6_K], ids=lambda t: ggml.TYPE_NAMES[t])
def test_bf16_activations(lib, type_id):
    K = 512
    part = ggml.Part(type_id, blocks(type_id, 16, K))
    w = reference(part, K)
    layer = ggml.BlockLinear([part], K, lib=lib, max_rows=MAX_ROWS)
    for M in (3, 300):
        x, bias = torch.randn(M, K).to(torch.bfloat16), torch.randn(16).to(torch.bfloat16)
        y = layer(x, bias)
        assert y.dtype == torch.bfloat16
        check(y, x, w, column_blocks(part), bias.float(), route="int" if M <= MAX_ROWS else "tiles")


@pytest.mark.parametrize("type_id", ALL_TYPES, ids=lambda t: ggml.TYPE_NAMES[t])
def test_dequantize_rows_equal_reference(lib, type_id):
    """gg_dequant_rows is gguf-py's arithmetic bit for bit; listed rows (repeats, any order) and bf16 out."""
    K = 512
    part = ggml.Part(type_id, blocks(type_id, 11, K, pad=3))
    w = reference(part, K)
    assert torch.equal(ggml.dequantize(part, K, lib=lib), w)
    rows = torch.tensor([7, 0, 10, 7, 3])
    assert torch.equal(ggml.dequantize(part, K, rows, lib=lib), w[rows])
    assert torch.equal(ggml.dequantize(part, K, rows, torch.bfloat16, lib=lib), w[rows].to(torch.bfloat16))
    with pytest.raises(IndexError):
        ggml.dequantize(part, K, torch.tensor([11]), lib=lib)


def test_rows_do_not_depend_on_the_batch_or_threads(lib, monkeypatch):
    """In batch-invariant mode a row's output is the same bits whatever other rows share the call (the kernels
    over 8, 4, 2, 1 rows at once; no Q6_K tile regrouped at 16 rows or more) and however many threads split the
    columns."""
    from tokenmill.layers import batch_invariant

    monkeypatch.setattr(batch_invariant, "_enabled", True)
    K = 512
    parts = [ggml.Part(t, blocks(t, 13, K)) for t in (ggml.Q4_K, ggml.Q8_0, ggml.Q6_K, ggml.BF16)]
    layer = ggml.BlockLinear(parts, K, lib=lib, max_rows=64)
    x = torch.randn(21, K)
    y = layer(x, None)
    for i in (0, 9, 20):
        assert torch.equal(layer(x[i:i + 1], None), y[i:i + 1])
    y8 = kernel_call(layer, lib.gg_linear_invariant, x)  # the int8 kernel too (float32 x above: the precise one)
    for i in (0, 9, 20):
        assert torch.equal(kernel_call(layer, lib.gg_linear_invariant, x[i:i + 1].contiguous()), y8[i:i + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x, None), y)
    finally:
        torch.set_num_threads(threads)


def test_torch_fallback_without_the_library(monkeypatch):
    K = 256
    part = ggml.Part(ggml.Q4_K, blocks(ggml.Q4_K, 6, K))
    monkeypatch.setattr(ggml, "load", lambda: None)
    layer = ggml.bind([part], K)
    x = torch.randn(3, K)
    w = reference(part, K)
    torch.testing.assert_close(layer(x, None), x @ w.t())
    assert torch.equal(ggml.dequantize(part, K, torch.tensor([2, 1])), w[[2, 1]])


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        ggml.row_bytes(ggml.Q4_K, 300)
    with pytest.raises(ValueError, match="too short"):
        ggml.bind([ggml.Part(ggml.Q4_0, torch.zeros(4, 17, dtype=torch.uint8))], 32)
    with pytest.raises(ValueError, match="unsupported"):
        ggml.block_size(99)


def test_row_limits_follow_the_measured_crossovers():
    """A merged layer routes by the smallest row limit of its parts' types (ggml.MAX_ROWS_BF16's table)."""
    from tokenmill.host import cpu_has_native_bf16

    def part(type_id):
        return ggml.Part(type_id, torch.zeros(2, ggml.row_bytes(type_id, 256), dtype=torch.uint8))

    q6k, mixed = ggml.bind([part(ggml.Q6_K)], 256), ggml.bind([part(ggml.Q6_K), part(ggml.IQ4_NL)], 256)
    if cpu_has_native_bf16():  # bf16 x against bf16 tiles
        assert (q6k.max_rows, mixed.max_rows) == (32, 16)
    else:  # bf16 x (int8 activations) against float32 tiles
        assert (q6k.max_rows, mixed.max_rows) == (ggml.NO_ROW_LIMIT, 32)  # Q6_K: tiles regrouped to x8
    q4k = ggml.bind([part(ggml.Q4_K)], 256)
    assert (q4k.row_limit(torch.float32), mixed.row_limit(torch.float32)) == (96, 64)  # float32 x: two passes
    assert q6k.row_limit(torch.bfloat16) == q6k.max_rows
    assert ggml.BlockLinear([part(ggml.Q8_0)], 256, max_rows=5).max_rows == 5


@pytest.mark.parametrize("type_id", [ggml.Q4_0, ggml.Q4_K], ids=lambda t: ggml.TYPE_NAMES[t])
def test_x8_repack_in_runs_of_rows_releases_each_once_copied(lib, type_id, monkeypatch):
    """`repacked` copies a large part a run of whole 8-row groups at a time and hands each run of source rows to
    release once copied (gguf_blocks pages a mapped file's rows out, so source and copy are never both resident in
    full): the same bytes as one pass, the runs covering the rows once, in order."""
    if ggml.isa(lib) == "scalar":
        pytest.skip("the scalar build has no x8 layout")
    K = 512
    part = ggml.Part(type_id, blocks(type_id, 40, K, pad=5))
    whole = ggml.repacked(part, K, lib)
    monkeypatch.setattr(ggml, "REPACK_CHUNK_BYTES", 16 * ggml.row_bytes(type_id, K) + 7)  # runs of 16 rows
    runs: list[torch.Tensor] = []
    chunked = ggml.repacked(part, K, lib, release=runs.append)
    assert chunked.type == whole.type == 1000 + type_id and torch.equal(chunked.data, whole.data)
    assert [r.shape[0] for r in runs] == [16, 16, 8]
    assert [r.data_ptr() for r in runs] == [part.data[i].data_ptr() for i in (0, 16, 32)]


@pytest.mark.parametrize("type_id", ggml.REPACKABLE, ids=lambda t: ggml.TYPE_NAMES[t])
def test_x8_repack_matches_reference(lib, type_id):
    """`bind` runs the REPACKABLE types from copies repacked eight rows at a time (not on the scalar build, which
    has no x8 kernel): merged with a part of another type, the threads' column split on a group bound, both routes and
    both kernels within the derived bounds, lookups of single rows exact; the caller's part is left as it is. Its 40
    rows are five groups: a pass of one row of x on one thread reads four at once (Q8_0: four streams of one group;
    the others: two of two) and the fifth alone."""
    for K in (512, 768) if ggml.block_size(type_id)[0] == 256 else (512, 288):
        part, other = ggml.Part(type_id, blocks(type_id, 40, K, pad=5)), ggml.Part(ggml.Q8_0, blocks(ggml.Q8_0, 5, K))
        before = part.data.clone()
        w = torch.cat([reference(part, K), reference(other, K)])
        layer = ggml.bind([part, other], K, lib=lib)
        packed = layer.parts[0]
        repacks = ggml.isa(lib) != "scalar" and (type_id != ggml.Q6_K or "vnni" in ggml.isa(lib))  # Q6_K: VNNI only
        assert packed.type == (1000 + type_id if repacks else type_id)
        assert torch.equal(part.data, before) and layer.parts[1] is other
        assert torch.equal(ggml.unpacked(packed, K).data, before[:, :ggml.row_bytes(type_id, K)])
        rows = torch.tensor([39, 0, 9, 9, 16])
        assert torch.equal(ggml.dequantize(packed, K, rows, lib=lib), w[rows])
        assert torch.equal(ggml.dequantize(packed, K, lib=lib), w[:40])
        routed = ggml.BlockLinear(layer.parts, K, lib=lib, max_rows=MAX_ROWS)  # the tests' row limit
        check_routes(routed, lib, w, column_blocks(part, other), (1, 3, 8, 13, 20, 40))  # 20: decoded tiles
