"""Roofline arithmetic: FLOPs and bytes of prefill and decode, which one limits, and the speeds it allows.

A step's time is at least max(FLOPs / peak FLOP/s, bytes / bandwidth). Its arithmetic intensity
(FLOPs per byte moved) against the hardware's ops:byte ratio says which term wins. Bytes are the weights
the step touches (all of them for a dense model; the expected distinct experts for MoE) plus the KV cache
it reads and writes. Activations and communication are left out, so these are bounds, not predictions; a
split over several devices adds its communication in plan["parallel"] (perf/parallel.py).

engine/step_stats.py applies the same counts to the engine's real steps (`--log-step-stats`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenmill.perf.hardware import Hardware, Interconnect, default_links
from tokenmill.perf.memory import GGUF, MemoryPlan, ModelShape, memory_plan, normalize_dtype


@dataclass
class Cost:
    flops: float
    bytes: float

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")


def step_cost(shape: ModelShape, tokens: int, attn_pairs: float, kv_tokens_read: float, weight_dtype: str,
              kv_dtype: str, decode: bool = False, logits_tokens: Optional[float] = None) -> Cost:
    """One forward step over `tokens` tokens whose attention spans `attn_pairs` (query, key) pairs and
    reads `kv_tokens_read` cached tokens (each token's own K/V is written once). The LM head runs only for
    the `logits_tokens` positions that are sampled (default: every token; a prefill samples one per prompt)."""
    head = shape.embedding_params()
    logits = tokens if logits_tokens is None else logits_tokens
    flops = (2.0 * (shape.matmul_params_active - head) * tokens + 2.0 * head * logits
             + shape.attention_flops_per_pair(decode) * attn_pairs)
    kvb = shape.kv_bytes_per_token(kv_dtype)
    nbytes = shape.weight_bytes_read(tokens, weight_dtype) + (kv_tokens_read + tokens) * kvb
    return Cost(flops, nbytes)


def scheduled_cost(shape: ModelShape, sched: Any, weight_dtype: str, kv_dtype: str) -> Cost:
    """The cost of one engine step (a SchedulerOutput): each request's chunk attends to its cached prefix."""
    pairs = kv_read = sampled = 0
    for r in sched.scheduled:
        n, s = len(r.token_ids), r.start_pos
        pairs += n * s + n * (n + 1) // 2
        kv_read += s
        sampled += r.num_spec + 1  # (a prompt chunk that does not end the prompt samples nothing: counted anyway)
    return step_cost(shape, sched.num_batched_tokens, pairs, kv_read, weight_dtype, kv_dtype, logits_tokens=sampled)


def prefill_cost(shape: ModelShape, batch: int, input_len: int, weight_dtype: str, kv_dtype: str) -> Cost:
    pairs = batch * input_len * (input_len + 1) / 2  # causal
    return step_cost(shape, batch * input_len, pairs, 0, weight_dtype, kv_dtype, logits_tokens=batch)


def decode_cost(shape: ModelShape, batch: int, context_len: float, weight_dtype: str, kv_dtype: str) -> Cost:
    return step_cost(shape, batch, batch * context_len, batch * context_len, weight_dtype, kv_dtype, decode=True)


def roofline_time(cost: Cost, peak_flops: float, bandwidth: float) -> float:
    return max(cost.flops / peak_flops, cost.bytes / bandwidth)


def compute_bound_batch(shape: ModelShape, context_len: float, ops_per_byte: float, weight_dtype: str,
                        kv_dtype: str, limit: int = 1 << 24) -> Optional[int]:
    """Smallest decode batch whose intensity reaches the ops:byte ratio; None if none up to `limit` does
    (the KV reads grow with the batch as fast as the FLOPs, so long contexts may never get there).
    Intensity rises monotonically with the batch (weight bytes are shared, KV bytes are not)."""
    def ai(b: int) -> float:
        return decode_cost(shape, b, context_len, weight_dtype, kv_dtype).arithmetic_intensity

    if ai(limit) < ops_per_byte:
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if ai(mid) >= ops_per_byte:
            hi = mid
        else:
            lo = mid + 1
    return lo


def default_compute_dtype(weight_dtype: str) -> str:
    """Weight-only 4-bit formats run their matmuls in bf16; fp8/int8/fp4 weights use those units."""
    w = normalize_dtype(weight_dtype)
    return {"fp32": "fp32", "fp16": "fp16", "fp8": "fp8", "int8": "int8", "fp4": "fp4"}.get(w, "bf16")


def _memory_notes(mem: MemoryPlan, hw: Hardware, devices: int, batch_size: int, crossover: Optional[int]) -> list[str]:
    """What memory leaves out: room for no sequence, a batch beyond what fits, a crossover beyond it."""
    notes = []
    if mem.max_concurrent_seqs == 0:
        notes.append(f"the weights ({mem.weight_bytes / 2**30:.1f} GiB) leave no room for even one sequence's KV "
                     f"in {devices} x {hw.memory_bytes / 2**30:.0f} GiB; use more GPUs (--tp) or smaller dtypes")
    elif batch_size > mem.max_concurrent_seqs:
        notes.append(f"batch size {batch_size} exceeds the {mem.max_concurrent_seqs} sequences whose KV fits")
    if crossover is not None and crossover > mem.max_concurrent_seqs:
        notes.append(f"decode turns compute-bound only at batch {crossover}, beyond what memory holds")
    return notes


def make_plan(shape: ModelShape, hw: Hardware, weight_dtype: str = "bf16", kv_dtype: Optional[str] = None,
              batch_size: int = 1, input_len: int = 2048, output_len: int = 256, tp: int = 1,
              compute_dtype: Optional[str] = None, memory_utilization: float = 0.9, pp: int = 1,
              expert_parallel: bool = False, **parallel: Any) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (see `tokenmill plan --help` for the meaning of each key). Speeds
    are over the tp devices of one stage (a batch visits the pp stages in turn), memory over all tp x pp;
    `parallel` (devices_per_node, node_link, net_link, max_batched_tokens) goes to attach_parallel."""
    if min(batch_size, input_len, tp, pp) < 1 or output_len < 0:
        raise ValueError("batch size, input length, TP and PP sizes must be at least 1, output length at least 0")
    weight_dtype = normalize_dtype(weight_dtype)
    kv_dtype = normalize_dtype(kv_dtype) if kv_dtype and kv_dtype != "auto" else \
        ("fp32" if weight_dtype == "fp32" else "bf16")
    wanted = normalize_dtype(compute_dtype) if compute_dtype else default_compute_dtype(weight_dtype)
    used, peak1 = hw.peak_flops(wanted)
    notes = []
    if used != wanted:
        notes.append(f"{hw.name} has no {wanted} figure: matmuls counted at {used}")
    peak, bw = peak1 * tp, hw.bandwidth * tp
    ratio = peak1 / hw.bandwidth
    context = input_len + output_len
    mem = memory_plan(shape, weight_dtype, kv_dtype, context, hw.memory_bytes, tp * pp, memory_utilization)

    pre = prefill_cost(shape, batch_size, input_len, weight_dtype, kv_dtype)
    pre1 = prefill_cost(shape, 1, input_len, weight_dtype, kv_dtype)
    dec_ctx = input_len + output_len / 2  # mean context over the decode
    dec = decode_cost(shape, batch_size, dec_ctx, weight_dtype, kv_dtype)
    step = roofline_time(dec, peak, bw)
    crossover = compute_bound_batch(shape, dec_ctx, ratio, weight_dtype, kv_dtype)

    notes += _memory_notes(mem, hw, tp * pp, batch_size, crossover)

    def bound(c: Cost) -> str:
        return "compute" if c.arithmetic_intensity >= ratio else "memory"

    plan = {
        "model": shape.name, "hardware": hw.name, "hardware_measured": hw.measured, "tp": tp, "pp": pp,
        "weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "compute_dtype": used,
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "context_len": context,
        "params_total": shape.params_total, "params_active": shape.params_active, "is_moe": shape.is_moe,
        "weight_bytes": mem.weight_bytes, "kv_bytes_per_token": mem.kv_bytes_per_token,
        "kv_bytes_per_seq": mem.kv_bytes_per_seq, "memory_bytes": mem.memory_bytes,
        "memory_utilization": memory_utilization, "max_concurrent_seqs": mem.max_concurrent_seqs,
        "min_gpus": mem.min_gpus,
        "peak_flops": peak1, "bandwidth": hw.bandwidth, "ops_per_byte": ratio,
        "prefill": {"tokens": batch_size * input_len, "flops": pre.flops, "bytes": pre.bytes,
                    "arithmetic_intensity": pre.arithmetic_intensity, "bound": bound(pre),
                    "ttft_s": roofline_time(pre, peak, bw), "ttft_s_batch1": roofline_time(pre1, peak, bw)},
        "decode": {"context_len": dec_ctx, "flops": dec.flops, "bytes": dec.bytes,
                   "arithmetic_intensity": dec.arithmetic_intensity, "bound": bound(dec),
                   "step_time_s": step, "tokens_per_s_per_user": 1.0 / step, "tokens_per_s_total": batch_size / step,
                   "compute_bound_batch_size": crossover},
        "notes": notes,
    }
    if weight_dtype == GGUF:  # what the engine maps: each tensor in its own ggml type
        plan["gguf"] = {**shape.gguf.as_dict(), "summary": shape.gguf.describe()}
    if tp * pp > 1 or expert_parallel:
        attach_parallel(plan, shape, hw, expert_parallel, **parallel)
    return plan


def attach_parallel(plan: dict[str, Any], shape: ModelShape, hw: Hardware, expert_parallel: bool,
                    devices_per_node: Optional[int] = None, node_link: Optional[Interconnect] = None,
                    net_link: Optional[Interconnect] = None, max_batched_tokens: int = 2048) -> None:
    """plan["parallel"]: per-device memory and communication of the plan's split (perf/parallel.py)."""
    from tokenmill.perf.parallel import Split, parallel_plan  # ~4 ms: the engine's step stats import this module

    split = Split(plan["tp"], plan["pp"], expert_parallel)
    links = default_links(hw)
    dpn = devices_per_node or (split.world if hw.name == "local-cpu" else 8)
    plan["parallel"] = parallel_plan(
        shape, hw, split, plan["weight_dtype"], plan["kv_dtype"], plan["batch_size"], plan["input_len"],
        plan["context_len"], plan["memory_utilization"], max_batched_tokens, dpn, node_link or links[0],
        net_link or links[1], plan["decode"]["step_time_s"], plan["prefill"]["ttft_s"])
    # per-device arithmetic knows replicated KV heads and activations: its count is the one that holds
    plan["max_concurrent_seqs"] = plan["parallel"]["max_concurrent_seqs"]
    if plan["weight_dtype"] == GGUF and split.tp > 1:
        _note_cut_blocks(plan, shape, split)
    if not shape.is_mla and shape.num_kv_heads < split.tp:
        plan["notes"].append(f"{shape.num_kv_heads} KV heads on {split.tp} TP ranks: each KV head is held "
                             f"{split.tp // shape.num_kv_heads} times")


def _note_cut_blocks(plan: dict[str, Any], shape: ModelShape, split: Any) -> None:
    """Tensor parallel splits the input of the attention output and MLP down projections: where a rank's
    share does not fall on a type's blocks, the engine holds those shards as float32, beyond these figures."""
    widths = [shape.num_heads * shape.head_dim // split.tp]
    widths += [shape.intermediate_size // split.tp] if shape.intermediate_size else []
    widths += [shape.moe_intermediate_size // split.tp] if shape.is_moe and not split.ep else []
    cut = shape.gguf.cut_blocks(tuple(widths))
    if cut:
        plan["notes"].append(f"TP={split.tp} splits the row-parallel layers' inputs into {', '.join(map(str, widths))} "
                             f"columns, which cut {', '.join(cut)} blocks: the engine holds those shards as float32, "
                             "more memory and bytes per token than counted here")


def _si(x: float, unit: str) -> str:
    for div, p in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {p}{unit}"
    return f"{x:.2f} {unit}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB" if x >= 2**20 else f"{x / 1024:.1f} KiB"


def format_plan(p: dict[str, Any]) -> str:
    pre, dec = p["prefill"], p["decode"]
    active = f" ({_si(p['params_active'], '')} active)" if p["is_moe"] else ""
    hw = p["hardware"] + (" (measured now)" if p["hardware_measured"] else "")
    cross = dec["compute_bound_batch_size"]
    lines = [
        f"{p['model']} on {p['tp'] * p['pp']} x {hw}: weights {p['weight_dtype']}, KV {p['kv_dtype']}, "
        f"matmuls {p['compute_dtype']}",
        f"  parameters        {_si(p['params_total'], '')}{active}",
        f"  weights           {_gib(p['weight_bytes'])}" + (f", {p['gguf']['summary']}" if "gguf" in p else ""),
        f"  KV cache          {_gib(p['kv_bytes_per_token'])} per token, {_gib(p['kv_bytes_per_seq'])} per sequence "
        f"of {p['context_len']} tokens",
        f"  memory            {_gib(p['memory_bytes'])} total; at {p['memory_utilization']:.0%} fits "
        f"{p['max_concurrent_seqs']} concurrent sequences",
        f"  min GPUs          {p['min_gpus']} (memory >= 1.5 x weights)",
        f"  hardware          {_si(p['peak_flops'], 'FLOP/s')} {p['compute_dtype']}, {_si(p['bandwidth'], 'B/s')}: "
        f"ops:byte {p['ops_per_byte']:.3g}",
        f"  prefill           {pre['tokens']} tokens (batch {p['batch_size']} x {p['input_len']}): intensity "
        f"{pre['arithmetic_intensity']:.0f} -> {pre['bound']}-bound; TTFT >= {pre['ttft_s'] * 1e3:.1f} ms"
        + (f" (batch 1: {pre['ttft_s_batch1'] * 1e3:.1f} ms)" if p["batch_size"] > 1 else ""),
        f"  decode            batch {p['batch_size']} at context {dec['context_len']:.0f}: intensity "
        f"{dec['arithmetic_intensity']:.1f} -> {dec['bound']}-bound; step >= {dec['step_time_s'] * 1e3:.2f} ms",
        f"                    <= {dec['tokens_per_s_per_user']:.1f} tok/s per user, "
        f"<= {dec['tokens_per_s_total']:.1f} tok/s total",
        "  compute-bound at  " + (f"decode batch {cross}" if cross is not None else
                                  "never (KV reads grow as fast as the FLOPs at this context)"),
    ]
    if "parallel" in p or "rules_pick" in p:
        from tokenmill.perf.parallel import format_choice, format_parallel  # ~4 ms, as in attach_parallel

        lines += format_parallel(p["parallel"]) if "parallel" in p else []
        lines += format_choice(p["rules_pick"]) if "rules_pick" in p else []
    lines += [f"  note: {n}" for n in p["notes"]]
    return "\n".join(lines)
