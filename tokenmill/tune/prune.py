"""Prune and rank configurations before measuring anything, with `tokenmill plan`'s memory and roofline model.

A configuration is pruned when it cannot work even in theory: its weights and KV cache do not fit the
machine, its KV cache holds not one sequence of the workload, or the roofline's lower bound on TTFT, TPOT
(per accepted token, so speculation can beat one step), ITL or E2E already exceeds the SLA. The rest get a
predicted objective from the same arithmetic (decode step at the batch the load and --max-num-seqs allow,
prefill of the prompt tokens prefix caching does not save) so that the search measures the likeliest winners
first. The roofline is a bound, not a forecast: speculation's acceptance and the engine's overheads are not
in it, so the ranking orders, and the measurements decide.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.perf.hardware import Hardware
from tokenmill.perf.memory import ModelShape, dtype_bytes, normalize_dtype
from tokenmill.perf.roofline import decode_cost, default_compute_dtype, prefill_cost, roofline_time

logger = logging.getLogger("tokenmill")

_QUANT_DTYPE = {"int8": "int8", "w8a8": "int8", "fp8": "fp8", "mxfp4": "fp4", "nvfp4": "fp4"}
CPU_KV_DEFAULT = 4 * 2**30  # the engine's default --kv-cache-memory-bytes on CPU
# A floor must exceed its limit by this factor to prune: hardware figures measured on a busy machine run low
# (so floors run high), and a wrongly pruned winner is never seen again, while a hopeless trial costs one run.
FLOOR_MARGIN = 2.0


@dataclass
class Workload:
    input_len: int              # prompt tokens besides a shared prefix
    output_len: int
    prefix_len: int = 0         # shared system prompt (the shared-prefix dataset)
    num_prompts: int = 100


@dataclass
class Machine:
    hw: Hardware
    model_dtype: str            # what --dtype auto picks here (fp32 or bf16)
    shared: bool                # data-parallel replicas share this hardware (CPU) rather than own devices
    memory_utilization: float = 0.9


def parse_bytes(text: Any) -> int:
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 1e3, "mb": 1e6, "gb": 1e9, "b": 1}
    s = str(text).strip().lower()
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(float(s) * (2**30 if float(s) < 4096 else 1))  # plain numbers: GiB when small, as the engine reads


def dtypes(config: dict[str, Any], machine: Machine) -> tuple[str, str]:
    """(weight dtype, KV dtype) of a configuration."""
    model = normalize_dtype(config["dtype"]) if config.get("dtype") not in (None, "auto") else machine.model_dtype
    weight = _QUANT_DTYPE.get(config.get("quantization") or "", model)
    kv = config.get("kv_cache_dtype")
    return weight, (model if kv in (None, "auto") else normalize_dtype(kv.split("_")[0]))


def _speed(machine: Machine, weight: str, replicas: int, devices: int) -> tuple[float, float]:
    peak = machine.hw.peak_flops(default_compute_dtype(weight))[1]
    bw = machine.hw.bandwidth
    if machine.shared:
        return peak / replicas, bw / replicas
    return peak * devices, bw * devices


def predict(config: dict[str, Any], shape: ModelShape, machine: Machine, work: Workload,
            fixed: dict[str, Any]) -> dict[str, Any]:
    """Roofline figures of one configuration: {"pruned": reason} or the predicted latencies and speeds."""
    cfg = {**fixed, **{k: v for k, v in config.items() if v is not None}}
    weight, kv = dtypes(cfg, machine)
    dp, tp, pp = (int(cfg.get(k) or 1) for k in ("data_parallel_size", "tensor_parallel_size",
                                                  "pipeline_parallel_size"))
    peak, bw = _speed(machine, weight, dp, tp * pp)
    ctx = work.prefix_len + work.input_len + work.output_len
    kv_seq = shape.kv_bytes_per_seq(kv, ctx)  # sliding-window layers keep only their window
    weights = shape.params_total * dtype_bytes(weight)
    if machine.shared:  # CPU: the KV cache is what --kv-cache-memory-bytes says, per replica
        kv_bytes = parse_bytes(cfg.get("kv_cache_memory_bytes") or CPU_KV_DEFAULT)
        need, have = dp * (weights + kv_bytes), machine.hw.memory_bytes * machine.memory_utilization
    else:
        kv_bytes = tp * pp * machine.hw.memory_bytes * machine.memory_utilization - weights
        need, have = dp * weights, dp * tp * pp * machine.hw.memory_bytes * machine.memory_utilization
    if need > have:
        return {"pruned": f"needs {need / 2**30:.1f} GiB for weights and KV, {have / 2**30:.1f} GiB usable"}
    fit = int(kv_bytes // kv_seq) if kv_seq else 1 << 30
    if fit < 1:
        return {"pruned": f"a KV cache of {kv_bytes / 2**20:.0f} MiB holds no sequence of {ctx} tokens"}
    cached = work.prefix_len if cfg.get("enable_prefix_caching") is not False else 0
    uncached = max(1, work.prefix_len + work.input_len - cached)
    spec = cfg.get("speculative_config")
    per_step = 1 + (spec.get("num_speculative_tokens", 0) if isinstance(spec, dict) else 0)
    mid = work.prefix_len + work.input_len + work.output_len / 2
    conc = cfg.get("max_concurrency") or work.num_prompts
    batch = max(1, min(math.ceil(conc / dp), int(cfg.get("max_num_seqs") or 256), fit))
    # floors: one request alone, with the whole of its hardware (an idle replica's neighbours leave it all)
    full_peak, full_bw = _speed(machine, weight, 1, tp * pp)
    t_pre_min = roofline_time(prefill_cost(shape, 1, uncached, weight, kv), full_peak, full_bw)
    t_dec_min = roofline_time(decode_cost(shape, 1, mid, weight, kv), full_peak, full_bw)
    t_pre1 = roofline_time(prefill_cost(shape, 1, uncached, weight, kv), peak, bw)
    t_dec = roofline_time(decode_cost(shape, batch, mid, weight, kv), peak, bw)
    wave = batch * t_pre1 + work.output_len * t_dec  # a batch's prefills, then its decode
    return {"batch": batch, "fits_seqs": fit, "ttft_min_s": t_pre_min, "tpot_min_s": t_dec_min / per_step,
            "itl_min_s": t_dec_min, "ttft_s": batch * t_pre1, "tpot_s": t_dec,
            "output_tok_s": dp * batch * work.output_len / wave, "per_user_tok_s": 1.0 / t_dec,
            "devices": 1 if machine.shared else dp * tp * pp}


def sla_impossible(pred: dict[str, Any], slo: dict[str, float], work: Workload) -> Optional[str]:
    """Why the roofline's lower bounds already break the SLA, or None."""
    floor = {"ttft": pred["ttft_min_s"], "tpot": pred["tpot_min_s"], "itl": pred["itl_min_s"],
             "e2e": pred["ttft_min_s"] + (work.output_len - 1) * pred["tpot_min_s"]}
    for key, limit in slo.items():
        metric = key.partition("_p")[0]
        if floor[metric] > FLOOR_MARGIN * limit:
            return (f"{key} >= {floor[metric] * 1e3:.3g}ms even alone (roofline), over {FLOOR_MARGIN:g}x the "
                    f"limit {limit * 1e3:g}ms")
    return None


def predicted_score(pred: dict[str, Any], objective: str, slo: dict[str, float], work: Workload) -> float:
    """The objective as the roofline sees it (higher is better)."""
    if objective == "per_user_tps":
        return pred["per_user_tok_s"]
    if objective == "cost":
        return pred["output_tok_s"] / pred["devices"]
    if objective == "throughput":
        return pred["output_tok_s"]
    rate = pred["output_tok_s"] / work.output_len
    est = {"ttft": pred["ttft_s"], "tpot": pred["tpot_s"], "itl": pred["tpot_s"],
           "e2e": pred["ttft_s"] + work.output_len * pred["tpot_s"]}
    misses = sum(est[k.partition("_p")[0]] > v for k, v in slo.items())
    return rate / (1 + 9 * misses)  # a predicted miss is likely, not certain: rank it low, keep it


def prune_and_rank(configs: list[dict[str, Any]], shape: Optional[ModelShape], machine: Optional[Machine],
                   work: Workload, slo: dict[str, float], objective: str,
                   fixed: dict[str, Any]) -> tuple[list[tuple[dict, dict]], list[tuple[dict, str]]]:
    """(kept, pruned): kept as (config, prediction) best predicted first (ties: fewer changes first), pruned
    as (config, reason). Without a model shape or hardware figures nothing is pruned and the order stays."""
    if shape is None or machine is None:
        return [(c, {}) for c in configs], []
    kept, pruned = [], []
    for c in configs:
        pred = predict(c, shape, machine, work, fixed)
        reason = pred.get("pruned") or sla_impossible(pred, slo, work)
        if reason:
            pruned.append((c, reason))
        else:
            pred["score"] = predicted_score(pred, objective, slo, work)
            kept.append((c, pred))
    kept.sort(key=lambda cp: (-cp[1]["score"], sum(v is not None for v in cp[0].values())))
    return kept, pruned
