"""The measured matmul plan (layers/matmul_plan.py): every path it can choose equals the torch reference in
each dtype, the choice is forced by TOKENMILL_MATMUL, batch-invariant mode never leaves the panel kernel, the
cache is dropped when the CPU or the kernels change, and --dtype auto measures where the checkpoint names no
dtype."""
import argparse
import json
import logging
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from tokenmill import config, host
from tokenmill.layers import batch_invariant, cpu_linear, matmul_plan
from tokenmill.models import resolution

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache folder (compiled kernels are copied, not rebuilt)."""
    kernels = os.path.join(host.cache_root(), "kernels")
    if os.path.isdir(kernels):
        shutil.copytree(kernels, tmp_path / "kernels")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(matmul_plan.ENV, "measure")  # conftest forces the panel elsewhere
    yield tmp_path


def _weights(dtype, N=40, K=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(dtype) for s in ((700, K), (N, K), (N,))]


@pytest.mark.parametrize("path", ["panel", "torch", "measure"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_choosable_path_matches_the_reference(path, dtype, monkeypatch):
    monkeypatch.setenv(matmul_plan.ENV, path)
    x, w, b = _weights(dtype)
    packed = cpu_linear.pack(w)
    if path != "measure":
        assert (packed.plan.batched, packed.plan.prefill) == (path, path)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    with torch.inference_mode():
        for M in (1, 8, 9, 64, 512, 513, 700):
            y = cpu_linear.linear(x[:M], w, b, packed)
            assert y.dtype == dtype and y.shape == (M, w.shape[0])
            torch.testing.assert_close(y.float(), F.linear(x[:M].float(), w.float(), b.float()), **tol)
            if path == "torch" and M > matmul_plan.DECODE_ROWS:  # torch's own result, bit for bit
                assert torch.equal(y, F.linear(x[:M], w, b))
            if path == "panel" or M <= matmul_plan.DECODE_ROWS:
                assert torch.equal(y, cpu_linear.panel_linear(x[:M], packed, b))


def test_batch_invariant_mode_stays_on_the_panel_kernel(monkeypatch):
    monkeypatch.setenv(matmul_plan.ENV, "torch")
    x, w, b = _weights(torch.float32)
    torch_plan = cpu_linear.pack(w)
    batch_invariant.enable(True)
    try:
        packed = cpu_linear.pack(w)
        assert packed.plan == matmul_plan.PANEL_ONLY
        with torch.inference_mode():
            full = cpu_linear.linear(x, w, b, torch_plan)  # even a plan measured before: panel
            for lo, hi in ((0, 1), (3, 12), (7, 300), (100, 700)):
                assert torch.equal(cpu_linear.linear(x[lo:hi], w, b, torch_plan), full[lo:hi])
    finally:
        batch_invariant.enable(False)


def test_plan_classes_and_row_limits():
    plan = matmul_plan.MatmulPlan("torch", "panel")
    assert [plan.torch_serves(m) for m in (1, 8, 9, 512, 513)] == [False, False, True, True, False]
    assert matmul_plan.panel_row_limit([matmul_plan.PANEL_ONLY, plan]) == matmul_plan.DECODE_ROWS
    assert matmul_plan.panel_row_limit([matmul_plan.MatmulPlan("panel", "torch")]) == matmul_plan.PREFILL_LIMIT
    assert matmul_plan.panel_row_limit([matmul_plan.PANEL_ONLY]) == float("inf")


def test_bad_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(matmul_plan.ENV, "fastest")
    with pytest.raises(ValueError, match="TOKENMILL_MATMUL must be measure, panel or torch"):
        matmul_plan.forced_path()


def test_measured_choices_are_cached_and_dropped_when_cpu_or_kernels_change(own_cache, monkeypatch):
    _, w, _ = _weights(torch.float32)
    calls = []
    run = lambda x: calls.append(x.shape[0]) or cpu_linear.panel_linear(x, cpu_linear._panels(w))  # noqa: E731
    first = matmul_plan.measure(w, run)
    assert calls and set(first.times) == {"batched", "prefill"}
    path = own_cache / "matmul_plans.json"
    data = json.loads(path.read_text())
    assert data["cpu"] == matmul_plan.cpu_identity() and data["kernels"] == matmul_plan.kernel_identity()
    assert list(data["plans"]) == ["float32 40x48 t%d" % torch.get_num_threads()]

    calls.clear()
    matmul_plan._Cache._instance = None  # a new process: reads the file
    assert matmul_plan.measure(w, run) == first and not calls  # cached: nothing timed

    for changed in ("kernel_identity", "cpu_identity"):
        with monkeypatch.context() as m:
            m.setattr(matmul_plan, changed, lambda: "something else")
            matmul_plan._Cache._instance = None
            calls.clear()
            matmul_plan.measure(w, run)
            assert calls, f"a changed {changed} must measure again"
    matmul_plan._Cache._instance = None


def test_kernel_identity_follows_the_kernel_sources(monkeypatch, tmp_path):
    before = matmul_plan.kernel_identity()
    for name in matmul_plan._SOURCES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(os.path.dirname(matmul_plan.__file__), name), tmp_path / name)
    monkeypatch.setattr(matmul_plan, "__file__", str(tmp_path / "matmul_plan.py"))
    assert matmul_plan.kernel_identity() == before
    seen = {before}
    for name in ("skinny_linear.c", "quantization/ggml.c"):  # the panel kernel's, the block kernels'
        (tmp_path / name).write_text((tmp_path / name).read_text() + "\n/* v2 */\n")
        seen.add(matmul_plan.kernel_identity())
    assert len(seen) == 3


def test_dtype_auto_measures_when_the_checkpoint_names_none(caplog):
    cfg = type("Cfg", (), dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16))()
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        dtype = resolution.resolve_dtype("auto", None, "cpu", cfg)
    assert dtype in (torch.float32, torch.bfloat16)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--dtype auto"))
    assert "float32" in line and "bfloat16" in line and " us" in line
    # the checkpoint's own dtype wins; a forced path measures nothing
    assert resolution.resolve_dtype("auto", "bfloat16", "cpu", cfg) == torch.bfloat16
    assert resolution.resolve_dtype("auto", "float32", "cpu", cfg) == torch.float32


# SmolLM2-135M's layer shapes (the default model): what `tokenmill serve` resolves --dtype auto for
SMOLLM2 = type("Cfg", (), dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                               num_key_value_heads=3, head_dim=64))()


class VirtualCPU:
    """A clock that moves only when a matmul runs, by what that matmul costs on a model CPU (ns per
    multiply-add, by path and dtype; by default an AVX512-BF16 CPU where oneDNN's bf16 beats the fp32 panel
    kernel 1.7x), times `load` while a neighbour spins. `neighbour` says when it spins: never (quiet), or
    from the first bfloat16 matmul on (it arrived partway through the measurement and stayed).
    Installed as matmul_plan's timer and as both matmul paths, so no assertion depends on real timings."""
    AVX512_BF16 = {("torch", torch.bfloat16): 1.0, ("panel", torch.bfloat16): 5.0,
                   ("torch", torch.float32): 2.0, ("panel", torch.float32): 1.7}

    def __init__(self, cost=None, neighbour="never", load=3.0):
        self.cost, self.neighbour, self.load = cost or self.AVX512_BF16, neighbour, load
        self.now, self.busy, self.runs = 0.0, False, 0

    def run(self, path, x, N, K):
        self.runs += 1
        if self.neighbour == "with the first bfloat16 matmul" and x.dtype == torch.bfloat16:
            self.busy = True
        self.now += x.shape[0] * N * K * self.cost[(path, x.dtype)] * 2e-11 * (self.load if self.busy else 1.0)
        return torch.empty(x.shape[0], N, dtype=x.dtype)

    def install(self, monkeypatch):
        from types import SimpleNamespace

        monkeypatch.setattr(matmul_plan, "time", SimpleNamespace(perf_counter=lambda: self.now))
        monkeypatch.setattr(matmul_plan, "F",
                            SimpleNamespace(linear=lambda x, w, b=None: self.run("torch", x, *w.shape)))
        monkeypatch.setattr(cpu_linear, "_panels",
                            lambda w: SimpleNamespace(linear=lambda x: self.run("panel", x, *w.shape)))
        return self


def _native_bf16(monkeypatch, has):
    monkeypatch.setattr(resolution, "cpu_has_native_bf16", lambda: has)


def test_dtype_auto_is_not_a_coin_toss_on_a_busy_first_start(monkeypatch):
    """Issue 29, defect 2: the first start timed float32, then bfloat16 while a neighbour had begun to spin,
    picked float32, and its cached timings picked float32 again on every later (quiet) start. Now the CPU's
    bf16 support decides, and the interleaved pairs see the neighbour on both dtypes alike."""
    _native_bf16(monkeypatch, True)
    VirtualCPU(neighbour="with the first bfloat16 matmul").install(monkeypatch)
    assert resolution.resolve_dtype("auto", None, "cpu", SMOLLM2) == torch.bfloat16
    VirtualCPU().install(monkeypatch)  # the next start, quiet, with the cache the first one left
    assert resolution.resolve_dtype("auto", None, "cpu", SMOLLM2) == torch.bfloat16


@pytest.mark.parametrize("native, cost, expected", [
    (True, VirtualCPU.AVX512_BF16, torch.bfloat16),  # the prior, confirmed
    (False, VirtualCPU.AVX512_BF16, torch.bfloat16),  # overturned: bf16 1.7x faster, every time
    (True, {**VirtualCPU.AVX512_BF16, ("torch", torch.bfloat16): 4.0}, torch.float32),  # overturned
    (False, {**VirtualCPU.AVX512_BF16, ("torch", torch.bfloat16): 1.6}, torch.float32),  # 1.06x: within margin
])
def test_dtype_auto_prior_and_clear_margin_overturn(native, cost, expected, monkeypatch, caplog):
    _native_bf16(monkeypatch, native)
    VirtualCPU(cost).install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        assert resolution.resolve_dtype("auto", None, "cpu", SMOLLM2) == expected
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("--dtype auto"))
    assert "float32" in line and "bfloat16" in line and line.count(" us") >= 2  # both numbers


def test_dtype_auto_decides_once_per_cpu_and_model_shapes(monkeypatch, caplog):
    """Issue 29, defect 5: a start without a resolution record (--skip-tokenizer-init writes none) must not
    race the dtypes again: the rule's decision is cached (never the race's timings), with its reason."""
    _native_bf16(monkeypatch, False)
    VirtualCPU().install(monkeypatch)
    assert resolution.resolve_dtype("auto", None, "cpu", SMOLLM2) == torch.bfloat16  # overturned, twice
    matmul_plan._Cache._instance = None  # the next start: a new process reads the file
    later = VirtualCPU(cost={**VirtualCPU.AVX512_BF16, ("torch", torch.bfloat16): 9.0}).install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        assert resolution.resolve_dtype("auto", None, "cpu", SMOLLM2) == torch.bfloat16
    assert later.runs == 0  # nothing timed
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--dtype auto")][-1]
    assert "decided at an earlier start" in line and "float32" in line and " us" in line
    matmul_plan._Cache._instance = None


def test_dtype_overturn_must_hold_in_every_round():
    """One round in which the challenger wins by the margin (a neighbour hit the prior's runs) is not enough:
    the second, separate round must say so too."""
    clock = [0.0]

    def runner(us, slow_first_round=False):
        calls = []

        def run(now):
            calls.append(now())
            slowed = slow_first_round and len(calls) <= matmul_plan.PAIRS + 1  # warm-up + the first round
            return us * (3.0 if slowed else 1.0) / 1e6
        return run

    def race(prior_run, other_run):
        return matmul_plan.race_dtypes(torch.bfloat16, prior_run, torch.float32, other_run, clock=lambda: clock[0])

    dtype, why = race(runner(1.0, slow_first_round=True), runner(1.2))
    assert dtype == torch.bfloat16 and why.startswith("kept bfloat16") and why.count(" us") == 4  # 2 rounds
    dtype, why = race(runner(2.0), runner(1.0))  # float32 2x faster, every time
    assert dtype == torch.float32 and why.count(" us") == 2 * matmul_plan.DTYPE_ROUNDS
    assert "float32 1.0 us" in why and "bfloat16 2.0 us" in why  # both numbers, per row
    dtype, why = race(runner(1.0), runner(1.05))  # within the margin: one round, prior kept
    assert dtype == torch.bfloat16 and why.count(" us") == 2


def test_dtype_auto_rule_as_serve_help_states_it():
    """`tokenmill serve --help` (and the README) state the rule with the numbers the code uses."""
    assert f"at least {matmul_plan.MARGIN}x faster" in config.DTYPE_AUTO_RULE
    assert matmul_plan.DTYPE_ROUNDS == 2 and "each of two separate rounds" in config.DTYPE_AUTO_RULE
    parser = argparse.ArgumentParser()
    config.EngineConfig.add_cli_args(parser)
    assert " ".join(config.DTYPE_AUTO_RULE.split()) in " ".join(parser.format_help().split())


def test_dtype_auto_is_bfloat16_for_a_gguf_served_in_its_blocks(monkeypatch):
    """Its block kernels run, not the float matmuls the race would time: bfloat16 (int8 activations, as
    llama.cpp's) on any CPU, unmeasured; the same shapes from another checkpoint still follow the CPU's rule."""
    from types import SimpleNamespace

    from tokenmill.models import resolution

    shape = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(resolution, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(cpu_linear, "measured_dtype", lambda shapes, prior: (prior, "kept (stub race)"))
    native = SimpleNamespace(tokenmill_gguf_file="/models/m.gguf", **shape)
    assert resolution.resolve_dtype("auto", None, "cpu", native) == torch.bfloat16
    assert resolution.resolve_dtype("auto", None, "cpu", SimpleNamespace(**shape)) == torch.float32
    assert resolution.resolve_dtype("float32", None, "cpu", native) == torch.float32
    assert "GGUF served in its own block types" in config.DTYPE_AUTO_RULE


def _fake_race(outcomes):
    """_race stand-in: outcomes[rows] = (integer ms, tiles ms); the rows raced, in order, into `raced`."""
    raced = []

    def race(a, b):  # the runners are not called
        rows = matmul_plan.BLOCK_PROBES[len(raced)]
        raced.append(rows)
        i, t = outcomes[rows]
        return i, t, i / t
    return race, raced


@pytest.mark.parametrize("prior, outcomes, expected", [
    (40, {16: (1, 3), 64: (2, 3), 256: (9, 5)}, 64),           # held up to 64, lost at 256: 64
    (100, {16: (1, 3), 64: (2, 3), 256: (9, 5)}, 100),         # the prior stands between the probes
    (32, {16: (3, 1)}, 15),                                    # lost at the first probe: under it
    (40, {16: (1, 3), 64: (2, 3), 256: (9, 9.5)}, 256),        # a tie is the integer kernel's
    (1 << 20, {16: (1, 3), 64: (2, 3), 256: (9, 9.5)}, 1 << 20),  # past the last probe the prior stands
])
def test_block_row_limit_walks_the_probes(prior, outcomes, expected, monkeypatch):
    race, raced = _fake_race(outcomes)
    monkeypatch.setattr(matmul_plan, "_race", race)
    args = (prior, 1.0, None, None, lambda rows: None)
    assert matmul_plan.block_row_limit("ggml test", *args) == expected
    assert raced == sorted(outcomes)  # stops at the first loss
    raced.clear()
    matmul_plan._Cache._instance = None  # a new process: the limit is read back, nothing raced
    assert matmul_plan.block_row_limit("ggml test", *args) == expected and not raced
    monkeypatch.setenv(matmul_plan.ENV, "panel")  # a forced path keeps the tables
    assert matmul_plan.block_row_limit("ggml other", *args) == prior and not raced


def test_block_row_limit_skips_probes_too_costly_to_time(monkeypatch):
    race, raced = _fake_race({16: (1, 3), 64: (2, 3)})
    monkeypatch.setattr(matmul_plan, "_race", race)
    flop_per_row = matmul_plan.MAX_FLOP / 100  # 64 rows fit, 256 do not
    assert matmul_plan.block_row_limit("ggml big", 40, flop_per_row, None, None, lambda r: None) == 64
    assert raced == [16, 64]


def test_gguf_block_layer_measures_its_row_limit_once(monkeypatch):
    """ggml.bind with the activations' dtype races the integer kernel against the tiles (the real kernels) and
    binds the layer at the limit it cached."""
    from tokenmill.layers.quantization import ggml
    if not ggml.available():
        pytest.skip("no ggml kernels")
    K, N = 256, 64
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (N, K // 32, 18), dtype=torch.uint8, generator=g)
    raw[..., :2] = (torch.rand(N, K // 32, generator=g) * 0.01).half().view(torch.uint8).reshape(N, K // 32, 2)
    layer = ggml.bind([ggml.Part(ggml.Q4_0, raw.reshape(N, -1))], K, dtype=torch.bfloat16)
    entries = matmul_plan._Cache.get().blocks
    key = next(k for k in entries if k.startswith("ggml ") and f" {N}x{K} bfloat16 " in k)
    assert layer.row_limit(torch.bfloat16) == entries[key]["limit"] >= 15
    assert set(entries[key]["times"]) <= set(matmul_plan.BLOCK_PROBES)
    x = torch.randn(300, K).to(torch.bfloat16)
    assert torch.allclose(layer(x, None).float(), ggml.bind(layer.parts, K, repack=False)(x, None).float(),
                          rtol=0.05, atol=0.05 * 8)
