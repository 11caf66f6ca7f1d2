"""Parallel splits: per-device memory, communication per token, and the split the rules pick.

The arithmetic follows what the engine does (tokenmill/distributed, layers/linear.py, layers/embedding.py,
layers/fused_moe.py):
- tensor parallel (TP) splits query heads, the attention output, the MLP width and the vocabulary (embedding
  and LM head rows, padded to a multiple of TP); KV heads are split, or replicated one per rank when there are
  fewer KV heads than ranks; norms and the MoE router are replicated. One all-reduce of the hidden state per
  token after attention and one after the MLP, one after the embedding lookup, and an all-gather of the logits.
- pipeline parallel (PP) runs consecutive layers per stage (even split, earlier stages take the remainder);
  the first stage holds the embedding, the last the final norm and the LM head (its own copy when tied).
  Each stage boundary sends the hidden state and the residual of every token.
- expert parallel (EP) puts E/TP whole experts on each TP rank instead of 1/TP of every expert: the same bytes
  per device. Our engine keeps activations replicated (attention stays TP) and combines the experts' outputs
  with the same one all-reduce per layer as TP; an all-to-all EP would send each token's top_k copies.
Collective time = nominal latency + bytes one device sends / link bandwidth (a ring all-reduce sends
2(n-1)/n of the payload per device, an all-gather (n-1)/n of the gathered result).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from tokenmill.perf.hardware import INTERCONNECTS, Hardware, Interconnect
from tokenmill.perf.memory import ModelShape, dtype_bytes, memory_plan


@dataclass(frozen=True)
class Split:
    tp: int = 1
    pp: int = 1
    ep: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        return f"TP={self.tp}" + (f" x PP={self.pp}" if self.pp > 1 else "") + (" with EP" if self.ep else "")


def layers_per_stage(num_layers: int, pp: int) -> list[int]:
    from tokenmill.config import ParallelConfig  # the engine's own partition; ~11 ms, which `plan --help` skips

    return ParallelConfig(pipeline_parallel_size=pp).layers_per_stage(num_layers)


def check_split(shape: ModelShape, split: Split) -> None:
    """Refuse, in one line, a split the engine would refuse (its own head-divisibility rule)."""
    from tokenmill.config import ParallelConfig  # ~11 ms, which `plan --help` skips

    if split.tp < 1 or split.pp < 1:
        raise ValueError(f"--tensor-parallel-size and --pipeline-parallel-size must be at least 1, "
                         f"got {split.tp} and {split.pp}")
    cfg = SimpleNamespace(num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                          num_hidden_layers=shape.num_layers)
    ParallelConfig(tensor_parallel_size=split.tp, pipeline_parallel_size=split.pp)._check_model_divides(cfg)
    if split.ep and not shape.is_moe:
        raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {shape.name} is dense")
    if split.ep and shape.num_experts % split.tp:
        raise ValueError(f"{shape.num_experts} experts cannot be split evenly over {split.tp} expert-parallel ranks")
    widths = [("MLP intermediate size", shape.intermediate_size)]
    if shape.is_moe and not split.ep:
        widths.append(("expert intermediate size", shape.moe_intermediate_size))
    for what, width in widths:
        if width % split.tp:
            raise ValueError(f"{what} {width} is not divisible by --tensor-parallel-size {split.tp}")


# -- parameters and memory per device ----------------------------------------------------------------------
def kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    """KV heads one TP rank holds: split when there are at least TP of them, else one (replicated)."""
    return 0 if shape.is_mla else max(1, shape.num_kv_heads // tp)


def attention_params_per_rank(shape: ModelShape, tp: int) -> float:
    s, h = shape, shape.hidden_size
    if s.is_mla:  # down-projections (q_a, kv_a) and their norms replicated; the per-head up/out projections split
        rep = h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank
        if s.q_lora_rank:
            rep += h * s.q_lora_rank + s.q_lora_rank
        return rep + (s.attention_params() - rep) / tp
    d = s.head_dim
    q_o = 2 * h * s.num_heads * d + (s.num_heads * d if s.qkv_bias else 0) + (s.num_heads if s.attn_sinks else 0)
    kv = 2 * h * s.num_kv_heads * d + (2 * s.num_kv_heads * d if s.qkv_bias else 0)
    replicated = (2 * d if s.qk_norm else 0) + (h if s.o_bias else 0)  # the o bias is added after the all-reduce
    return q_o / tp + kv * kv_heads_per_rank(s, tp) / s.num_kv_heads + replicated


def layer_params_per_rank(shape: ModelShape, tp: int, moe: bool) -> float:
    """One decoder layer on one TP rank. Routed experts: E/tp whole experts (EP) or 1/tp of each (TP), the
    same count either way."""
    h = shape.hidden_size
    if moe:
        mlp = (shape.router_params() + shape.shared_expert_params() / tp
               + shape.num_experts * shape.expert_params() / tp)
    else:
        mlp = 3 * h * shape.intermediate_size / tp
    return attention_params_per_rank(shape, tp) + mlp + shape.norms_per_layer * h  # + the RMSNorms


def vocab_table_per_rank(shape: ModelShape, tp: int) -> int:
    return -(-shape.vocab_size // tp) * shape.hidden_size  # rows padded up as layers/embedding.vocab_block does


def stage_params(shape: ModelShape, split: Split) -> list[float]:
    """Parameters one rank of each pipeline stage holds. MoE models' dense layers are taken to be the first
    ones (DeepSeek's first_k_dense_replace; Qwen's mlp_only_layers may sit elsewhere)."""
    counts = layers_per_stage(shape.num_layers, split.pp)
    table = vocab_table_per_rank(shape, split.tp)
    out, first = [], 0
    for stage, n in enumerate(counts):
        p = sum(layer_params_per_rank(shape, split.tp, shape.is_moe and i >= shape.num_dense_layers)
                for i in range(first, first + n))
        first += n
        if stage == 0:
            p += table  # embedding
        if stage == split.pp - 1:  # final norm + LM head (a tied head is the embedding's tensor on one stage)
            p += shape.hidden_size + (table if not shape.tie_word_embeddings or split.pp > 1 else 0)
        out.append(p)
    return out


def act_dtype(weight_dtype: str) -> str:
    return "fp32" if weight_dtype == "fp32" else "bf16"


def activation_bytes(shape: ModelShape, tp: int, tokens: int, sampled: int, weight_dtype: str) -> float:
    """Largest live tensors of one forward step over `tokens` tokens on one TP rank, an estimate: hidden and
    residual, this rank's q/k/v, its MLP gate and up outputs (top_k experts' for MoE), and the gathered
    logits of the `sampled` rows (every rank holds the whole vocabulary's after the all-gather)."""
    s, b = shape, dtype_bytes(act_dtype(weight_dtype))
    qkv = (s.num_heads / tp + 2 * kv_heads_per_rank(s, tp)) * s.head_dim
    width = max(s.intermediate_size, s.experts_per_token * s.moe_intermediate_size
                + (s.shared_expert_intermediate_size or s.num_shared_experts * s.moe_intermediate_size)) / tp
    return tokens * b * (2 * s.hidden_size + qkv + 2 * width) + sampled * s.vocab_size * b


def device_memory(shape: ModelShape, split: Split, weight_dtype: str, kv_dtype: str, device_bytes: float,
                  memory_utilization: float, context_len: int, max_batched_tokens: int, batch: int) -> dict:
    """Per pipeline stage: weights, KV bytes per token of a block (the layer slots its layers use: every layer's
    without KV groups) and activations on one of its devices, and how many tokens of blocks fit beside them; the
    engine gives every rank the same number of blocks, so the tightest stage sets the run's capacity (a sequence
    holds a block-token per token in a full KV group, up to its window in a sliding one)."""
    counts = layers_per_stage(shape.num_layers, split.pp)
    kv_share = 1.0 if shape.is_mla else kv_heads_per_rank(shape, split.tp) / shape.num_kv_heads
    act = activation_bytes(shape, split.tp, max_batched_tokens, batch, weight_dtype)
    stages, first = [], 0
    for n, params in zip(counts, stage_params(shape, split)):
        weights = params * shape.bytes_per_param(weight_dtype)  # a GGUF's blocks split in proportion
        slots = shape.kv_slots_of(range(first, first + n))
        kv_tok = shape.kv_bytes_per_token(kv_dtype) * slots / shape.num_layers * kv_share
        free = device_bytes * memory_utilization - weights - act
        stages.append({"layers": n, "weight_bytes": int(weights), "kv_bytes_per_token": kv_tok,
                       "activation_bytes": int(act), "kv_tokens": max(0, int(free // kv_tok))})
        first += n
    largest = max(range(split.pp), key=lambda i: stages[i]["weight_bytes"])
    kv_tokens = min(st["kv_tokens"] for st in stages)
    return {"stages": stages, "largest_stage": largest, "kv_tokens": kv_tokens,
            "max_concurrent_seqs": kv_tokens // shape.kv_block_tokens_per_seq(context_len)}


# -- communication -----------------------------------------------------------------------------------------
def comm_per_token(shape: ModelShape, split: Split, weight_dtype: str) -> dict:
    """Bytes per token (per sampled token for the logits) that one device sends, summed over the stages a token
    passes through; payloads are activations in the step's dtype."""
    t, b, h = split.tp, dtype_bytes(act_dtype(weight_dtype)), shape.hidden_size
    payload = h * b
    all_reduces = 2 * shape.num_layers + 1 if t > 1 else 0  # after attention and MLP per layer, + embedding
    ring = 2 * (t - 1) / t
    k = shape.experts_per_token
    return {
        "all_reduce_payload": payload, "all_reduces": all_reduces, "all_reduce_sent": ring * payload,
        "tp_sent": all_reduces * ring * payload,
        "logits_gather_sent": (t - 1) * -(-shape.vocab_size // t) * b,  # ring all-gather: the other ranks' rows
        "pp_boundaries": split.pp - 1, "pp_sent_per_boundary": 2 * payload,  # hidden + residual
        # all-to-all EP for comparison: each token's top_k copies out (dispatch) and back (combine) per MoE
        # layer, the fraction (t-1)/t of them to another rank, each device carrying 1/t of the tokens
        "all_to_all_per_moe_layer": 2 * k * payload, "moe_layers": shape.num_moe_layers,
        "all_to_all_sent": shape.num_moe_layers * 2 * k * payload * (t - 1) / t / t,
    }


def comm_time(comm: dict, split: Split, tokens: int, sampled: int, node_link: Interconnect,
              net_link: Interconnect, devices_per_node: int) -> dict:
    """Seconds of one step's communication (no overlap with compute): TP collectives on the node link (the
    network when TP spans nodes), each pipeline hop on the network when its two stages sit on different nodes."""
    tp_link = node_link if split.tp <= devices_per_node else net_link
    tp = 0.0
    if split.tp > 1:
        tp = (comm["all_reduces"] + 1) * tp_link.latency + \
            (tokens * comm["tp_sent"] + sampled * comm["logits_gather_sent"]) / tp_link.bandwidth
    pp = 0.0
    for s in range(split.pp - 1):
        crosses = (s * split.tp) // devices_per_node != ((s + 1) * split.tp) // devices_per_node
        link = net_link if crosses else node_link
        pp += link.latency + tokens * comm["pp_sent_per_boundary"] / link.bandwidth
    return {"tp_s": tp, "pp_s": pp, "total_s": tp + pp, "tp_link": tp_link.name}


def comm_on_links(comm: dict, split: Split, tokens: int, sampled: int) -> dict[str, float]:
    """One step's communication time with every catalog link carrying all of it (loopback left out)."""
    return {link.name: comm_time(comm, split, tokens, sampled, link, link, split.world)["total_s"]
            for link in INTERCONNECTS.values() if link.name != "loopback"}


def busiest_rank_experts(shape: ModelShape, split: Split, tokens: int) -> tuple[float, float]:
    """(mean, expected maximum) over the TP ranks of the distinct experts one MoE layer's step touches on a
    rank, with uniform routing: each expert is touched with p = 1 - (1 - k/E)^tokens, a rank's count is
    Binomial(E/ranks, p) under EP. Under TP every rank reads its slice of every touched expert: the mean."""
    e, ranks = shape.num_experts, split.tp
    p = 1.0 - (1.0 - shape.experts_per_token / e) ** tokens
    n = e // ranks
    mean = e * p / ranks
    if not split.ep or ranks == 1:
        return mean, mean
    pmf = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    cdf = [sum(pmf[:i + 1]) for i in range(n + 1)]
    return mean, sum(1.0 - cdf[m - 1] ** ranks for m in range(1, n + 1))  # E[max] = sum_m P(max >= m)


# -- the plan for one split --------------------------------------------------------------------------------
def parallel_plan(shape: ModelShape, hw: Hardware, split: Split, weight_dtype: str, kv_dtype: str, batch: int,
                  input_len: int, context_len: int, memory_utilization: float, max_batched_tokens: int,
                  devices_per_node: int, node_link: Interconnect, net_link: Interconnect,
                  decode_compute_s: float, prefill_compute_s: float) -> dict[str, Any]:
    """Per-device memory, communication per token and per step, and the step with its communication added
    (compute from the roofline over the TP ranks: a batch visits the PP stages in turn)."""
    check_split(shape, split)
    # the local CPU's ranks are processes sharing this machine's memory
    device_bytes = hw.memory_bytes / split.world if hw.name == "local-cpu" else hw.memory_bytes
    mem = device_memory(shape, split, weight_dtype, kv_dtype, device_bytes, memory_utilization, context_len,
                        max_batched_tokens, batch)
    comm = comm_per_token(shape, split, weight_dtype)
    dec = comm_time(comm, split, batch, batch, node_link, net_link, devices_per_node)
    pre = comm_time(comm, split, batch * input_len, batch, node_link, net_link, devices_per_node)
    moe, wait = None, 0.0
    if shape.is_moe:
        mean, busiest = busiest_rank_experts(shape, split, batch)
        # decode is memory-bound: the busiest rank streams (busiest - mean) more experts per MoE layer
        wait = (busiest - mean) * shape.expert_params() * shape.num_moe_layers * shape.bytes_per_param(weight_dtype) \
            / (1 if split.ep else split.tp) / hw.bandwidth
        moe = {"experts_per_rank": shape.num_experts // split.tp if split.ep else shape.num_experts,
               "expert_width_per_rank": shape.moe_intermediate_size // (1 if split.ep else split.tp),
               "decode_experts_per_layer_mean": mean, "decode_experts_per_layer_busiest": busiest,
               "decode_imbalance_s": wait}
    step = decode_compute_s + wait + dec["total_s"]
    nodes = math.ceil(split.world / devices_per_node)
    return {
        "split": str(split), "tp": split.tp, "pp": split.pp, "expert_parallel": split.ep, "devices": split.world,
        "nodes": nodes, "devices_per_node": devices_per_node, "node_link": node_link.name,
        "network_link": net_link.name, "device_memory_bytes": int(device_bytes), **mem, "moe": moe,
        "comm_per_token": comm,
        "decode_comm": dec, "prefill_comm": pre,
        "decode_comm_on_links": comm_on_links(comm, split, batch, batch),
        "decode_compute_s": decode_compute_s, "decode_step_s": step,
        "decode_comm_fraction": dec["total_s"] / step if step else 0.0,
        "tokens_per_s_total": batch * split.pp / step,  # PP keeps pp batches in flight
        "ttft_s": prefill_compute_s + pre["total_s"],
    }


# -- the split the rules pick ------------------------------------------------------------------------------
def _valid(shape: ModelShape, split: Split) -> bool:
    try:
        check_split(shape, split)
    except ValueError:
        return False
    return True


def choose_split(shape: ModelShape, hw: Hardware, weight_dtype: str, num_nodes: int,
                 devices_per_node: int) -> dict[str, Any]:
    """The book's rules for one replica over num_nodes x devices_per_node devices: enough devices for the
    weights and a KV budget (memory >= 1.5 x weights); TP inside a node, as wide as the heads allow; PP only
    for what TP cannot take (across nodes); EP for a MoE model whose experts divide over the TP ranks."""
    devices = num_nodes * devices_per_node
    need = memory_plan(shape, weight_dtype, act_dtype(weight_dtype), 1, hw.memory_bytes).min_gpus
    if need > devices:
        return {"split": None, "min_devices": need, "reasons": [
            f"does not fit: needs at least {need} x {hw.name} (memory >= 1.5 x weights), {devices} given"]}
    ep = shape.is_moe
    sizes = [n for n in range(1, devices_per_node + 1) if devices % n == 0
             and _valid(shape, Split(n, devices // n, ep and shape.num_experts % n == 0))]
    if not sizes:
        return {"split": None, "min_devices": need, "reasons": [
            f"no TP size up to {devices_per_node} divides the heads and {devices} devices"]}
    tp = sizes[-1]
    split = Split(tp, devices // tp, ep and shape.num_experts % tp == 0)
    reasons = [f"needs >= {need} devices (memory >= 1.5 x weights)",
               f"TP={tp}: the widest split inside a node of {devices_per_node} that divides the "
               f"{shape.num_heads} heads"]
    if split.pp > 1:
        where = f"across {num_nodes} nodes" if split.pp == num_nodes else "for the devices TP cannot take"
        reasons.append(f"PP={split.pp}: {where}; only stage boundaries cross the slower link")
    if split.ep:
        reasons.append(f"EP: {shape.num_experts // tp} whole experts per rank for throughput (full-width expert "
                       "matmuls, which the roofline does not credit; same weight bytes and, in this engine, the same "
                       "all-reduce traffic as TP); at small batches its busiest rank reads more than TP's slices")
    smallest = next((n for n in sizes if n >= need), None)
    if smallest is not None and smallest < devices:
        reasons.append(f"the model fits on {smallest} device(s): {devices // smallest} replicas of TP={smallest} "
                       f"behind the router serve more sequences; one replica over all {devices} is the "
                       "lowest-latency split")
    return {"split": split, "min_devices": need, "reasons": reasons}


# -- text --------------------------------------------------------------------------------------------------
def _size(x: float) -> str:
    for div, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if x >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def format_parallel(par: dict[str, Any]) -> list[str]:
    st, c = par["stages"], par["comm_per_token"]
    where = (f"{par['nodes']} node(s) of {par['devices_per_node']}; TP on {par['decode_comm']['tp_link']}, "
             f"network {par['network_link']}")
    lines = [f"  split             {par['split']} = {par['devices']} devices over {where}"]
    for i, s in enumerate(st):
        held = " + embedding" * (i == 0) + " + LM head" * (i == len(st) - 1)
        lines.append(f"  per device        stage {i} ({s['layers']} layers{held}): weights {_size(s['weight_bytes'])}, "
                     f"KV {_size(s['kv_bytes_per_token'])}/token, activations {_size(s['activation_bytes'])}")
    lines.append(f"  largest stage     {par['largest_stage']}; KV fits {par['kv_tokens']} tokens per device -> "
                 f"{par['max_concurrent_seqs']} concurrent sequences")
    if par["moe"]:
        m = par["moe"]
        lines.append(f"  experts per rank  {m['experts_per_rank']} at width {m['expert_width_per_rank']}"
                     + (" (EP: whole experts)" if par["expert_parallel"] else " (TP: a slice of every expert)")
                     + f"; a decode step touches {m['decode_experts_per_layer_mean']:.2f} per rank per layer on "
                     f"average, the busiest rank {m['decode_experts_per_layer_busiest']:.2f} "
                     f"(+{_ms(m['decode_imbalance_s'])})")
    if par["tp"] > 1:
        lines.append(f"  TP traffic        {c['all_reduces']} all-reduces of {_size(c['all_reduce_payload'])} per "
                     f"token (2 per layer + embedding), ring sends {_size(c['all_reduce_sent'])} each = "
                     f"{_size(c['tp_sent'])} per token per device; logits all-gather "
                     f"{_size(c['logits_gather_sent'])} per sampled token")
    if par["pp"] > 1:
        lines.append(f"  PP traffic        {_size(c['pp_sent_per_boundary'])} per token per stage boundary "
                     f"(hidden + residual) x {c['pp_boundaries']}")
    if c["moe_layers"] and par["tp"] > 1:
        lines.append(f"  EP traffic        this engine: activations replicated, the MoE output combined by the "
                     f"layer's all-reduce above; all-to-all EP would move {_size(c['all_to_all_per_moe_layer'])} "
                     f"per token per MoE layer (top_k x hidden out and back), {_size(c['all_to_all_sent'])} per "
                     "batch token per device over all layers")
    dec = par["decode_comm"]
    links = ", ".join(f"{k} {_ms(v)}" for k, v in par["decode_comm_on_links"].items())
    imbalance = f" + {_ms(par['moe']['decode_imbalance_s'])} expert imbalance" if par["moe"] else ""
    in_flight = f" with {par['pp']} batches in flight" if par["pp"] > 1 else ""
    lines += [f"  decode comm       {_ms(dec['total_s'])} per step (TP {_ms(dec['tp_s'])}, PP {_ms(dec['pp_s'])}); "
              f"all of it on one link: {links}",
              f"  decode step       >= {_ms(par['decode_compute_s'])} roofline{imbalance} + {_ms(dec['total_s'])} "
              f"comm = {_ms(par['decode_step_s'])} ({par['decode_comm_fraction']:.0%} comm); "
              f"<= {par['tokens_per_s_total']:.1f} tok/s total{in_flight}",
              f"  prefill           TTFT >= {_ms(par['ttft_s'])} with {_ms(par['prefill_comm']['total_s'])} comm"]
    return lines


def format_choice(choice: dict[str, Any]) -> list[str]:
    head = f"  rules pick        {choice['split']}" if choice["split"] else "  rules pick        nothing"
    return [head] + [f"                    - {r}" for r in choice["reasons"]]
