"""One log line per engine step with its MFU/MBU (`--log-step-stats`): the step's cost from the cost model
(perf/) against the device's figures."""
from __future__ import annotations

import logging
import time
from typing import Any

from tokenmill.models.shape import engine_shape
from tokenmill.perf.hardware import for_device
from tokenmill.perf.memory import normalize_dtype
from tokenmill.perf.roofline import Cost, scheduled_cost

logger = logging.getLogger("tokenmill")


class StepStatsLogger:
    """One log line per engine step: tokens, batch size, step time, and MFU/MBU against the device's
    figures (measured on the spot for the CPU, from the catalog for a known GPU)."""

    def __init__(self, config: Any) -> None:
        self.dtype = normalize_dtype(str(config.model.torch_dtype))  # activations, KV and the FLOP/s figure
        self.shape, self.weight_dtype = engine_shape(config.model.hf_config, self.dtype)
        kv = getattr(config.cache, "kv_cache_dtype", "auto")
        self.kv_dtype = self.dtype if kv in (None, "auto") else normalize_dtype(kv)
        t = time.perf_counter()
        self.hw = for_device(config.device, self.dtype)
        self.peak = self.hw.peak_flops(self.dtype)[1] if self.hw else None
        self.num_steps = 0
        if self.hw:
            how = f"measured in {time.perf_counter() - t:.1f}s" if self.hw.measured else "datasheet"
            logger.info("step stats against %s (%s): %.1f GFLOP/s %s, %.1f GB/s", self.hw.name, how,
                        self.peak / 1e9, self.dtype, self.hw.bandwidth / 1e9)
        else:
            logger.info("step stats: unknown device, MFU/MBU not reported")

    def step_cost(self, sched: Any) -> Cost:
        return scheduled_cost(self.shape, sched, self.weight_dtype, self.kv_dtype)

    def log(self, sched: Any, seconds: float) -> dict[str, float]:
        self.num_steps += 1
        tokens, batch = sched.num_batched_tokens, len(sched.scheduled)
        stats = {"step": self.num_steps, "tokens": tokens, "batch": batch, "seconds": seconds}
        extra = ""
        if self.hw and seconds > 0:
            c = self.step_cost(sched)
            stats["mfu"] = c.flops / seconds / self.peak
            stats["mbu"] = c.bytes / seconds / self.hw.bandwidth
            extra = f", MFU {stats['mfu']:.1%}, MBU {stats['mbu']:.1%}"
        logger.info("step %d: %d tokens, batch %d, %.1f ms, %.0f tok/s%s", self.num_steps, tokens, batch,
                    seconds * 1e3, tokens / seconds if seconds > 0 else 0.0, extra)
        return stats
