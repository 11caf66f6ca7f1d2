"""Which CPU matmul path serves each row count of a packed linear layer: measured on this machine, not assumed.

Two paths can run a float linear layer that has a packed copy (cpu_linear.py):
- "panel": our register-blocked GEMM on the packed copy (skinny_linear.c), with a fixed reduction order;
- "torch": F.linear on the layer's own weight (oneDNN/MKL). On CPUs with native bf16 dot products
  (AVX512_BF16, AMX) oneDNN runs bf16 GEMMs at about twice the rate any kernel that widens bf16 to fp32 can
  reach; on AVX2-only CPUs the panel kernel is the faster one. Rather than encode either fact, we time both.

Row counts fall into three classes: decode (1-8 rows) always runs the panel kernel (the steps are
weight-streaming, and the one-call decoder stack needs it); batched (9-512) and prefill (> 512) are measured
at a representative row count each (BATCHED_ROWS, PREFILL_ROWS): the first time this CPU sees a (dtype, N, K,
threads), both paths run in back-to-back pairs, and torch replaces the panel kernel only where it wins by
MARGIN both in the best times and in the median pair (a noisy start must not lock in a wrong choice). Choices are cached in $TOKENMILL_CACHE_DIR/matmul_plans.json,
discarded as a whole when the CPU, the kernel sources or torch change. Batch-invariant mode always runs the
panel kernel (its order is what makes a row's result independent of the batch), whatever was measured.

TOKENMILL_MATMUL=panel|torch forces one path for every non-decode class (A/B runs, tests); the default,
"measure", times them.

ggml block layers (quantization/ggml.py) have the same two kinds of path: the integer kernel on the blocks, and
dequantized weight tiles + torch's GEMM. Their crossover moves far between CPUs (Q4_K x8 with bf16 x: ~40 rows
on one AVX-512 CPU, ~250 on another), so `block_row_limit` measures it per (types, shape, dtype, threads) at
BLOCK_PROBES rows, the tables in ggml.py being the prior; forcing a path (above) keeps the tables.

`choose_dtype` serves `--dtype auto` on a checkpoint that names no dtype. The CPU decides first: bfloat16
where it has native bf16 dot products (AVX512_BF16 or AMX), float32 elsewhere. A measurement may overturn
that prior, but only clearly and repeatedly: the model's own layer shapes (each on its planned path) run in
PAIRS interleaved float32/bfloat16 pairs, and the other dtype must win by MARGIN in both the best times and
the median pair, in each of DTYPE_ROUNDS separate rounds. The race itself is never cached: a first start
that timed one dtype while a neighbour was busy used to lock in the wrong choice for every later start
(issue 29). What sticks is only the rule's decision: in the start's resolution record
(models/resolution_cache.py), and here under the model's shapes, so that a start without a record (e.g. with
--skip-tokenizer-init) does not race again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from tokenmill.host import cache_root

logger = logging.getLogger("tokenmill")

DECODE_ROWS = 8        # up to here: always the panel kernel
BATCHED_ROWS = 64      # measured for 9-512 rows
PREFILL_ROWS = 1024    # measured for > 512 rows
PREFILL_LIMIT = 512
MARGIN = 1.1           # torch must be this much faster to be chosen
PAIRS = 5             # timed runs of each path
DTYPE_ROUNDS = 2       # separate rounds of PAIRS in which a measured dtype must beat the CPU's prior
MAX_FLOP = 8e9         # a single timed run above this (a large LM head at 1024 rows) is not worth it
ENV = "TOKENMILL_MATMUL"
CLASSES = ("batched", "prefill")
_SOURCES = ("skinny_linear.c", "cpu_vec.h", "quantization/ggml.c")
# rows at which a block layer's integer kernel and tiles are timed: batched steps. Not prefill's: timed alone at 512
# and 1024 rows the integer kernel won on a 0.5B's layers, and the model's prefill then ran 0.95x as fast
BLOCK_PROBES = (16, 64, 256)


class MatmulPlan(NamedTuple):
    """The path for each measured class, and the best times (ms) behind the choice (None: not measured)."""
    batched: str = "panel"
    prefill: str = "panel"
    times: Optional[dict] = None

    def torch_serves(self, rows: int) -> bool:
        if rows <= DECODE_ROWS:
            return False
        return (self.batched if rows <= PREFILL_LIMIT else self.prefill) == "torch"


PANEL_ONLY = MatmulPlan()


def forced_path() -> Optional[str]:
    """TOKENMILL_MATMUL's path, or None to measure."""
    value = os.environ.get(ENV, "measure")
    if value not in ("measure", "panel", "torch"):
        raise ValueError(f"{ENV} must be measure, panel or torch, not {value!r}")
    return None if value == "measure" else value


def _race(a: Callable[[], object], b: Callable[[], object]) -> tuple[float, float, float]:
    """Time a and b in PAIRS back-to-back pairs (alternating which goes first, so a busy neighbour hits both
    alike): (best ms of a, best ms of b, median of the pairs' a/b ratios)."""
    a(), b()  # warm: first-touch pages, oneDNN's primitive cache
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(PAIRS):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            (a, b)[j]()
            times[j].append(time.perf_counter() - t0)
    ratios = sorted(ta / tb for ta, tb in zip(*times))
    return min(times[0]) * 1e3, min(times[1]) * 1e3, ratios[len(ratios) // 2]


def measure(weight: torch.Tensor, run_panel: Callable[[torch.Tensor], torch.Tensor]) -> MatmulPlan:
    """Time the panel kernel (run_panel(x)) against F.linear(x, weight) for each class; cached per CPU."""
    forced = forced_path()
    if forced is not None:
        return MatmulPlan(forced, forced)
    N, K = weight.shape
    key = f"{str(weight.dtype).removeprefix('torch.')} {N}x{K} t{torch.get_num_threads()}"
    cache = _Cache.get()
    cached = cache.plan(key)
    if cached is not None:
        return cached
    choice, times, batched_choice = {}, {}, "panel"
    for cls, rows in zip(CLASSES, (BATCHED_ROWS, PREFILL_ROWS)):
        if 2.0 * rows * N * K > MAX_FLOP:
            choice[cls] = batched_choice  # too costly to time; such a layer rarely sees prefill rows
            continue
        x = torch.randn(rows, K).to(weight.dtype)
        with torch.no_grad():
            panel_ms, torch_ms, ratio = _race(lambda: run_panel(x), lambda: F.linear(x, weight))
        choice[cls] = "torch" if ratio > MARGIN and torch_ms * MARGIN < panel_ms else "panel"
        times[cls] = [round(panel_ms, 4), round(torch_ms, 4)]
        batched_choice = choice["batched"]
    plan = MatmulPlan(choice["batched"], choice["prefill"], times)
    cache.store(key, plan)
    return plan


def block_row_limit(key: str, prior: int, flop_per_row: float, run_int: Callable[[torch.Tensor], object],
                    run_tiles: Callable[[torch.Tensor], object], make_x: Callable[[int], torch.Tensor]) -> int:
    """The most rows of x a ggml block layer's integer kernel serves, tiles above (key: what the layer is, prior:
    its tables' limit). BLOCK_PROBES are timed in rising order (_race) until the tiles win by MARGIN, in the best
    times and the median pair: the limit rises to each probe the integer kernel held and stops under the first
    it lost, never below the prior there (rows between probes, and past the last, keep the tables' word). A
    probe above MAX_FLOP ends the walk. Cached per CPU with the plans."""
    if forced_path() is not None:
        return prior
    cache = _Cache.get()
    cached = cache.block_limit(key)
    if cached is not None:
        return cached
    limit, times = prior, {}
    for rows in BLOCK_PROBES:
        if rows * flop_per_row > MAX_FLOP:
            break
        x = make_x(rows)
        with torch.no_grad():
            int_ms, tiles_ms, ratio = _race(lambda: run_int(x), lambda: run_tiles(x))
        times[rows] = [round(int_ms, 4), round(tiles_ms, 4)]
        if ratio > MARGIN and tiles_ms * MARGIN < int_ms:
            limit = min(limit, rows - 1)
            break
        limit = max(limit, rows)
    cache.store_block_limit(key, limit, times)
    return limit


def _model_pass(dtype: torch.dtype, shapes: list[tuple[int, int]],
                pack: Callable[[torch.Tensor], Callable]) -> Optional[Callable[[Callable[[], float]], float]]:
    """One pass over the model's compute-bound steps in this dtype, each layer shape on the path its plan chose
    (as the engine would run it) at BATCHED_ROWS and PREFILL_ROWS rows: pass(clock) returns the summed
    seconds per row (each step's time over its rows, so both classes weigh the same per row). Decode steps
    are left out: they stream weights, so bfloat16 halves their bytes on every CPU. None: nothing to time
    (every step above MAX_FLOP)."""
    steps: list[tuple[Callable[[], object], int]] = []
    for N, K in shapes:
        weight = torch.randn(N, K).div_(K ** 0.5).to(dtype)
        run_panel = pack(weight)
        plan = measure(weight, run_panel)
        for rows in (BATCHED_ROWS, PREFILL_ROWS):
            if 2.0 * rows * N * K > MAX_FLOP:
                continue
            x = torch.randn(rows, K).to(dtype)
            run = (lambda x=x, w=weight: F.linear(x, w)) if plan.torch_serves(rows) else (lambda x=x, r=run_panel: r(x))
            steps.append((run, rows))
    if not steps:
        return None

    def run_pass(clock: Callable[[], float]) -> float:
        per_row = 0.0
        with torch.no_grad():
            for run, rows in steps:
                t0 = clock()
                run()
                per_row += (clock() - t0) / rows
        return per_row
    return run_pass


_PER_ROW = (f"matmul time per row of the model's shapes at {BATCHED_ROWS} and {PREFILL_ROWS} rows, best of "
            f"{PAIRS} interleaved pairs")


def _pairs(a: Callable[[Callable[[], float]], float], b: Callable[[Callable[[], float]], float],
           clock: Callable[[], float]) -> tuple[float, float, float]:
    """PAIRS back-to-back pairs of two passes (alternating which goes first, so a busy neighbour hits both
    alike): (best of a, best of b, median of the pairs' a/b ratios)."""
    a(clock), b(clock)  # warm: first-touch pages, oneDNN's primitive cache
    costs: tuple[list[float], list[float]] = ([], [])
    for i in range(PAIRS):
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):
            costs[j].append((a, b)[j](clock))
    ratios = sorted(ca / cb for ca, cb in zip(*costs))
    return min(costs[0]), min(costs[1]), ratios[len(ratios) // 2]


def race_dtypes(prior: torch.dtype, run_prior: Callable[[Callable[[], float]], float], other: torch.dtype,
                run_other: Callable[[Callable[[], float]], float],
                clock: Optional[Callable[[], float]] = None) -> tuple[torch.dtype, str]:
    """`other` replaces `prior` only if it is MARGIN faster in both the best pass and the median pair, in
    each of DTYPE_ROUNDS separate rounds of PAIRS interleaved pairs (a second round runs only when the
    first says overturn). run_x(clock) -> seconds per row. Returns the dtype and a line with both dtypes'
    per-row times (us) per round."""
    clock = clock or time.perf_counter
    name = {d: str(d).removeprefix("torch.") for d in (prior, other)}
    rounds = []
    for _ in range(DTYPE_ROUNDS):
        prior_s, other_s, ratio = _pairs(run_prior, run_other, clock)
        rounds.append(f"{name[prior]} {prior_s * 1e6:.1f} us, {name[other]} {other_s * 1e6:.1f} us, "
                      f"median pair {ratio:.2f}x")
        if not (ratio > MARGIN and prior_s > MARGIN * other_s):
            why = (f"kept {name[prior]}: {name[other]} was not {MARGIN}x faster in both best and median; "
                   f"{_PER_ROW}: " + "; then ".join(rounds))
            return prior, why
    why = (f"{name[other]} was {MARGIN}x faster in both best and median in each of {DTYPE_ROUNDS} rounds; "
           f"{_PER_ROW}: " + "; then ".join(rounds))
    return other, why


def choose_dtype(shapes: list[tuple[int, int]], pack: Callable[[torch.Tensor], Callable], prior: torch.dtype,
                 clock: Optional[Callable[[], float]] = None) -> tuple[torch.dtype, str]:
    """--dtype auto on a CPU for a model whose linear layers have these [N, K] shapes: `prior` (what the CPU
    has), unless the other of float32/bfloat16 beats it clearly and repeatedly here (race_dtypes).
    `pack(weight)` returns the panel-kernel callable for a weight. Returns the dtype and a one-line reason.
    Callers check forced_path() first: a forced path measures nothing."""
    other = torch.float32 if prior == torch.bfloat16 else torch.bfloat16
    key = f"prior {str(prior).removeprefix('torch.')} {shapes} t{torch.get_num_threads()}"
    cache = _Cache.get()
    decided = cache.dtype(key)
    if decided is not None:
        return getattr(torch, decided[0]), f"decided at an earlier start: {decided[1]}"
    run_prior, run_other = _model_pass(prior, shapes, pack), _model_pass(other, shapes, pack)
    if run_prior is None or run_other is None:
        return prior, f"not measured: every layer shape is above {MAX_FLOP:.0e} FLOP a step"
    dtype, why = race_dtypes(prior, run_prior, other, run_other, clock)
    cache.store_dtype(key, str(dtype).removeprefix("torch."), why)
    return dtype, why


def panel_row_limit(plans: list[MatmulPlan]) -> float:
    """The most rows every one of these plans runs on the panel kernel (inf: all row counts)."""
    if any(plan.batched == "torch" for plan in plans):
        return DECODE_ROWS
    if any(plan.prefill == "torch" for plan in plans):
        return PREFILL_LIMIT
    return float("inf")


def describe(plans: list[tuple[str, MatmulPlan]]) -> dict[str, str]:
    """One line per row class for the kernels report: which path serves it, for how many of the layers, and
    the summed measured times behind it."""
    lines = {f"1-{DECODE_ROWS} rows": "panel (decode; the one-call decoder stack)"}
    labels = (f"{DECODE_ROWS + 1}-{PREFILL_LIMIT} rows", f">{PREFILL_LIMIT} rows")
    for cls, label, rows in zip(CLASSES, labels, (BATCHED_ROWS, PREFILL_ROWS)):
        n_torch = sum(getattr(plan, cls) == "torch" for _, plan in plans)
        if n_torch == 0:
            line = f"panel for all {len(plans)} layers"
        elif n_torch == len(plans):
            line = f"torch (oneDNN/MKL) for all {len(plans)} layers"
        else:
            line = f"torch (oneDNN/MKL) for {n_torch} of {len(plans)} layers, panel for the rest"
        timed = [plan.times[cls] for _, plan in plans if plan.times and cls in plan.times]
        if timed:
            line += (f" (at {rows} rows, summed over {len(timed)} timed layers: panel "
                     f"{sum(t[0] for t in timed):.2f} ms, torch {sum(t[1] for t in timed):.2f} ms)")
        elif forced_path() is not None:
            line += f" ({ENV}={forced_path()})"
        lines[label] = line
    return lines


def cpu_identity() -> str:
    """The CPU model name and a hash of its feature flags (a cache key part)."""
    name, flags = "unknown", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "unknown":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line
    except OSError:
        pass
    return f"{name} {hashlib.sha256(flags.encode()).hexdigest()[:12]}"


def kernel_identity() -> str:
    """A hash of the panel and block kernels' sources and torch's version: any changing invalidates every choice."""
    h = hashlib.sha256(torch.__version__.encode())
    here = os.path.dirname(__file__)
    for name in _SOURCES:
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


class _Cache:
    """matmul_plans.json: {"cpu", "kernels", "plans": {key: {"batched", "prefill", "times"}}, "dtypes": {key:
    [dtype, why]}, "blocks": {key: {"limit", "times"}}}, one per process."""
    _instance: Optional["_Cache"] = None

    def __init__(self, path: str) -> None:
        self.path, self.identity = path, {"cpu": cpu_identity(), "kernels": kernel_identity()}
        self.plans: dict = {}
        self.dtypes: dict = {}
        self.blocks: dict = {}
        try:
            with open(path) as f:
                data = json.load(f)
            if all(data.get(k) == v for k, v in self.identity.items()):
                self.plans, self.dtypes = data.get("plans", {}), data.get("dtypes", {})
                self.dtypes = self.dtypes if isinstance(self.dtypes, dict) else {}
                self.blocks = data.get("blocks", {}) if isinstance(data.get("blocks"), dict) else {}
            else:
                logger.info("matmul plans: the CPU or the kernels changed since %s was written; measuring again",
                            path)
        except (OSError, ValueError, AttributeError):
            pass

    @classmethod
    def get(cls) -> "_Cache":
        path = os.path.join(cache_root(), "matmul_plans.json")
        if cls._instance is None or cls._instance.path != path:
            cls._instance = cls(path)
        return cls._instance

    def plan(self, key: str) -> Optional[MatmulPlan]:
        entry = self.plans.get(key)
        if not isinstance(entry, dict) or not all(entry.get(c) in ("panel", "torch") for c in CLASSES):
            return None
        return MatmulPlan(entry["batched"], entry["prefill"], entry.get("times"))

    def dtype(self, key: str) -> Optional[tuple[str, str]]:
        """(dtype name, the reason logged when it was decided) for --dtype auto, or None."""
        entry = self.dtypes.get(key)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in ("float32", "bfloat16")):
            return None
        return entry[0], str(entry[1])

    def block_limit(self, key: str) -> Optional[int]:
        entry = self.blocks.get(key)
        limit = entry.get("limit") if isinstance(entry, dict) else None
        return limit if isinstance(limit, int) and limit >= 0 else None

    def store_block_limit(self, key: str, limit: int, times: dict) -> None:
        self.blocks[key] = {"limit": limit, "times": times}
        self._write()

    def store_dtype(self, key: str, dtype: str, why: str) -> None:
        self.dtypes[key] = [dtype, why]
        self._write()

    def store(self, key: str, plan: MatmulPlan) -> None:
        self.plans[key] = plan._asdict()
        self._write()

    def _write(self) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({**self.identity, "plans": self.plans, "dtypes": self.dtypes, "blocks": self.blocks}, f,
                          indent=1, sort_keys=True)
            os.replace(tmp, self.path)  # atomic: concurrent engines never read half a file
        except OSError as e:
            logger.warning("matmul plans not cached (%s); they will be measured again next start", e)
