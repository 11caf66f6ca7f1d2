"""Per-step records for the live dashboard (serve/dashboard.py): what each engine step ran and how close it
came to the device's roofline.

The engine appends one small record per step to a bounded ring; EngineCore.stats() drains the ring into
the EngineStats that already travels to the API process with every step's outputs, so the records cost
one tuple of numbers per step and no extra message. MFU/MBU use the same FLOP and byte counts as
`--log-step-stats` (engine/step_stats.py) against the device's figures: the catalog entry for a known GPU, or
for the CPU an fp32 matmul and bandwidth probe measured once per machine and cached under
$TOKENMILL_CACHE_DIR/hardware/ (a bf16 probe takes tens of seconds on CPUs without bf16 units, so every
dtype is counted against the fp32 peak there).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import replace
from typing import Any, Optional

from tokenmill.host import cache_root, cpu_key
from tokenmill.perf.hardware import Hardware, for_device, measure_local_cpu
from tokenmill.perf.memory import ModelShape, normalize_dtype
from tokenmill.perf.roofline import scheduled_cost

logger = logging.getLogger("tokenmill")

# One record: [wall time at the step's end, seconds, prefill tokens, decode tokens, batch size, MFU, MBU]
# (MFU/MBU -1 when the device's figures are unknown). A list, not a struct: it rides inside EngineStats.
STEP_FIELDS = ("t", "seconds", "prefill", "decode", "batch", "mfu", "mbu")


def local_cpu_figures(measure: bool = True) -> Optional[Hardware]:
    """This CPU's fp32 peak and bandwidth as the engine process measured them (with its thread count),
    once per machine (about 2 s), then read from the cache. measure=False: None if not measured yet."""
    path = _cpu_figures_path()
    try:
        with open(path) as f:
            d = json.load(f)
        return Hardware("local-cpu", int(d["memory_bytes"]), float(d["bandwidth"]), dict(d["flops"]), measured=True)
    except (OSError, ValueError, KeyError, TypeError):
        if not measure:
            return None
    hw = measure_local_cpu(("fp32",))
    _write_cpu_figures(path, hw)
    return hw


def _cpu_figures_path() -> str:
    return os.path.join(cache_root(), "hardware", cpu_key() + ".json")


def _write_cpu_figures(path: str, hw: Hardware) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"memory_bytes": hw.memory_bytes, "bandwidth": hw.bandwidth, "flops": hw.flops}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the CPU's measured figures at %s: %s", path, e)


def device_figures(device: str) -> Optional[Hardware]:
    if device == "cpu":
        return local_cpu_figures()
    return for_device(device)


class StepRecorder:
    """A bounded ring of step records, drained into each EngineStats (at most `maxlen` kept between drains,
    so a stats consumer that stops reading never grows the engine's memory)."""

    def __init__(self, config: Any, maxlen: int = 256) -> None:
        self.shape = ModelShape.from_hf_config(config.model.hf_config)
        self.dtype = normalize_dtype(str(config.model.torch_dtype))
        kv = getattr(config.cache, "kv_cache_dtype", "auto")
        self.kv_dtype = self.dtype if kv in (None, "auto") else normalize_dtype(kv)
        self.hw = device_figures(config.device)
        self.peak = self.hw.peak_flops(self.dtype)[1] if self.hw is not None else None
        self.ring: deque = deque(maxlen=maxlen)
        self._cached_free, self._cached_free_at = 0, 0.0
        self._ceilings_raised = 0

    def cached_free_blocks(self, pool: Any, every: float = 0.25) -> int:
        """Free blocks that still hold a cached prefix (reusable until evicted). Counting walks the cached
        blocks, so it is refreshed at most every `every` seconds, not every step."""
        now = time.monotonic()
        if now - self._cached_free_at >= every:
            self._cached_free = sum(1 for b in pool.cached.values() if b.ref_cnt == 0)
            self._cached_free_at = now
        return self._cached_free

    def record(self, sched: Any, seconds: float) -> None:
        decode = sum(len(r.token_ids) for r in sched.scheduled if len(r.token_ids) - r.num_spec <= 1)
        mfu = mbu = -1.0
        if self.hw is not None and seconds > 0:
            cost = scheduled_cost(self.shape, sched, self.dtype, self.kv_dtype)
            if cost.bytes / seconds > self.hw.bandwidth or cost.flops / seconds > self.peak:
                self._raise_ceilings(cost.bytes / seconds, cost.flops / seconds)
            mfu, mbu = cost.flops / seconds / self.peak, cost.bytes / seconds / self.hw.bandwidth
        self.ring.append([time.time(), seconds, sched.num_batched_tokens - decode, decode, len(sched.scheduled),
                          mfu, mbu])

    def _raise_ceilings(self, bandwidth: float, flops: float) -> None:
        """A step beat the device's figures, so they were measured low (on a busy machine, or another
        thread count): the observed rates become the ceilings, which keeps MFU/MBU <= 100%. For the CPU the
        cached figures are corrected too, so the next start does not repeat the error."""
        old_bw, old_peak = self.hw.bandwidth, self.peak
        self.peak = max(self.peak, flops)
        self.hw = replace(self.hw, bandwidth=max(self.hw.bandwidth, bandwidth),
                          flops={**self.hw.flops, self.hw.peak_flops(self.dtype)[0]: self.peak})
        self._ceilings_raised += 1
        log = logger.warning if self._ceilings_raised == 1 else logger.debug
        log("a step ran at %.1f GB/s and %.1f GFLOP/s, above the %s figures (%.1f GB/s, %.1f GFLOP/s): "
                       "they were measured low; using the observed rates as the ceilings", bandwidth / 1e9,
                       flops / 1e9, self.hw.name, old_bw / 1e9, old_peak / 1e9)
        if self.hw.name == "local-cpu":
            _write_cpu_figures(_cpu_figures_path(), self.hw)

    def drain(self) -> list[list[float]]:
        out = list(self.ring)
        self.ring.clear()
        return out
