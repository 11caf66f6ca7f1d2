"""Tensor and pipeline parallel on this machine, measured, beside `tokenmill plan`'s prediction; then the plan
for the splits that matter on GPUs.

Part A (measured): decode step time of TP=1 (one process, 2 threads) vs TP=2 vs PP=2 (two processes, 1 thread
each) on a random-weight model of the default model's shape made divisible by 2: SmolLM2-135M has 9 query
heads of 64 and 3 KV heads; the variant has 8 heads of 72 and 2 KV heads (hidden 576, 30 layers, MLP 1536,
vocabulary 49152, tied). A decode step is (time of N output tokens - time of 1) / (N - 1) for a batch of B
prompts (best of --repeats). The plan's figure is a bound (roofline + communication), without the engine's
per-step Python and scheduling overhead, so the measured step sits above it. The engine does not report its collectives' time, so the communication of a
step is measured apart: two gloo processes all-reduce a [B, hidden] float32 tensor (TP does 2 per layer + 1
for the embedding), all-gather the [B, vocab/2] logits, and send/receive hidden + residual (PP's one
boundary); compute = step - that (an estimate: same sizes and backend, not inside the step). Beside each: the
plan's prediction for the same split (local CPU measured now at the rank's thread count, with the nominal
loopback link and with the link figures measured here). A split the engine refuses is reported with its
error, never a number.

Part B (plan only): Llama-3.1-70B bf16 on 8 x H100 (TP=8) vs 2 nodes of 8 (TP=8 x PP=2), and Qwen3-235B-A22B
bf16 on 8 x H200 with TP=8 vs EP, at batch 1 and 64.

On 2 cores, TP/PP are a correctness vehicle: two processes share the same two cores and memory bus and add
collectives, so they are not expected to beat one process; the win is on GPUs (Part B).

Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import load_average  # noqa: E402

SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2, head_dim=72,
             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=100000.0)
SPLITS = {"TP=1": dict(tensor_parallel_size=1), "TP=2": dict(tensor_parallel_size=2),
          "PP=2": dict(pipeline_parallel_size=2)}


def build_model(root: str, layers: int) -> tuple[str, dict]:
    import transformers

    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root, safe_serialization=True)
    return root, cfg.to_dict()


# -- Part A: the engine ------------------------------------------------------------------------------------
def _generate_s(llm, prompts, tokens: int) -> float:
    from tokenmill import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t


def measure_split(model: str, split: dict, batch: int, prompt_len: int, tokens: int, repeats: int) -> dict:
    """Best-of-repeats decode step time of one split, or the engine's refusal."""
    from tokenmill import LLM

    try:
        llm = LLM(model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes="256MiB",
                  enable_prefix_caching=False, max_num_seqs=batch, **split)
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(100, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()}
                   for _ in range(batch)]
        _generate_s(llm, prompts, 2)  # warm up
        step = float("inf")
        for _ in range(repeats):
            step = min(step, (_generate_s(llm, prompts, tokens) - _generate_s(llm, prompts, 1)) / (tokens - 1))
        return {"decode_step_ms": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    finally:
        llm.engine.shutdown()


# -- Part A: the collectives, apart --------------------------------------------------------------------------
def _timed(fn, reps: int) -> float:
    import torch.distributed as dist

    fn()
    dist.barrier()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _comm_rank(rank: int, port: int, batch: int, hidden: int, vocab: int, reps: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, big = torch.randn(batch, hidden), torch.randn(1 << 20)  # a step's payload; 4 MiB for the bandwidth
    logits = torch.randn(batch, vocab // 2)
    parts = [torch.empty_like(logits) for _ in range(2)]
    pair = [torch.randn(batch, hidden) for _ in range(2)]

    def ping_pong():  # PP's hop: hidden + residual to the other stage and back (timed, then halved)
        for step in (0, 1):
            for t in pair:
                dist.send(t, 1 - rank) if rank == step else dist.recv(t, 1 - rank)

    res = {"all_reduce_s": _timed(lambda: dist.all_reduce(x), reps),
           "all_reduce_4MiB_s": _timed(lambda: dist.all_reduce(big), max(5, reps // 10)),
           "all_gather_logits_s": _timed(lambda: dist.all_gather(parts, logits), reps),
           "send_recv_s": _timed(ping_pong, reps) / 2}
    if rank == 0:
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def measure_comm(batch: int, hidden: int, vocab: int, reps: int = 200) -> dict:
    """Median seconds of each collective of a step, between two gloo processes of this machine."""
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from dist_utils import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_comm_rank, args=(r, port, batch, hidden, vocab, reps, out)) for r in range(2)]
    for p in procs:
        p.start()
    res = out.get(timeout=300)
    for p in procs:
        p.join(timeout=30)
    return res


def measured_link(comm: dict, payload: int):
    """An Interconnect from the measurements: bandwidth from the 4 MiB all-reduce (over 2 ranks a ring sends
    2(n-1)/n = all of the payload per rank), latency from the step-sized one less its bytes' time."""
    from tokenmill.plan.hardware import Interconnect

    bandwidth = 4 * 2**20 / comm["all_reduce_4MiB_s"]
    latency = max(0.0, comm["all_reduce_s"] - payload / bandwidth)
    return Interconnect("loopback-measured", bandwidth, latency, "node", "gloo on this machine, measured now")


# -- the plan's predictions ----------------------------------------------------------------------------------
def rank_hardware(threads: int, bandwidth_share: float = 1.0):
    """This CPU measured at `threads` threads; bandwidth_share < 1 when ranks stream memory at the same time."""
    from dataclasses import replace

    from tokenmill.plan.hardware import measure_local_cpu

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        hw = measure_local_cpu(("fp32",))
    finally:
        torch.set_num_threads(before)
    return replace(hw, bandwidth=hw.bandwidth * bandwidth_share)


def predict(shape, hw, tp: int, pp: int, batch: int, prompt_len: int, tokens: int, link=None) -> dict:
    from tokenmill.plan import make_plan

    links = {"node_link": link, "net_link": link} if link else {}
    p = make_plan(shape, hw, "fp32", "fp32", batch, prompt_len, tokens, tp, "fp32", 0.9, pp, **links)
    par = p.get("parallel")
    if par is None:
        return {"decode_step_ms": round(p["decode"]["step_time_s"] * 1e3, 3), "comm_ms": 0.0, "bytes_per_token": 0}
    c = par["comm_per_token"]
    return {"decode_step_ms": round(par["decode_step_s"] * 1e3, 3),
            "comm_ms": round(par["decode_comm"]["total_s"] * 1e3, 3),
            "bytes_per_token": int(c["tp_sent"] + c["logits_gather_sent"]
                                   + c["pp_boundaries"] * c["pp_sent_per_boundary"])}


def part_a(args) -> dict:
    from tokenmill.plan import ModelShape

    root = tempfile.mkdtemp(prefix="tokenmill-parallel-")
    model, cfg = build_model(root, args.layers)
    shape = ModelShape.from_hf_config(cfg, name="SmolLM2-shape, 8 heads x 72, 2 KV heads")
    comm = measure_comm(args.batch, SHAPE["hidden_size"], SHAPE["vocab_size"])
    link = measured_link(comm, args.batch * SHAPE["hidden_size"] * 4)
    hw = {1: rank_hardware(2), "tp": rank_hardware(1, 0.5), "pp": rank_hardware(1)}
    measured_comm = {"TP=1": 0.0, "TP=2": (2 * args.layers + 1) * comm["all_reduce_s"] + comm["all_gather_logits_s"],
                     "PP=2": comm["send_recv_s"]}
    out = {}
    for name, split in SPLITS.items():
        tp, pp = split.get("tensor_parallel_size", 1), split.get("pipeline_parallel_size", 1)
        r = measure_split(model, split, args.batch, args.prompt_len, args.tokens, args.repeats)
        if "decode_step_ms" in r:
            r["comm_ms_measured_apart"] = round(measured_comm[name] * 1e3, 3)
            r["compute_ms_estimate"] = round(r["decode_step_ms"] - r["comm_ms_measured_apart"], 3)
        key = 1 if tp * pp == 1 else ("tp" if tp > 1 else "pp")
        r["plan_nominal_link"] = predict(shape, hw[key], tp, pp, args.batch, args.prompt_len, args.tokens)
        r["plan_measured_link"] = predict(shape, hw[key], tp, pp, args.batch, args.prompt_len, args.tokens, link)
        out[name] = r
    return {"model": shape.name, "config": {**SHAPE, "num_hidden_layers": args.layers}, "splits": out,
            "collectives_s": {k: round(v, 6) for k, v in comm.items()},
            "link_measured": {"bandwidth_GB_s": round(link.bandwidth / 1e9, 3),
                              "latency_us": round(link.latency * 1e6, 1)},
            "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens,
                         "repeats": args.repeats}}


# -- Part B: the plan only -----------------------------------------------------------------------------------
PART_B = [("Llama-3.1-70B", "h100", dict(tp=8)), ("Llama-3.1-70B", "h100", dict(tp=8, pp=2)),
          ("Qwen3-235B-A22B", "h200", dict(tp=8)), ("Qwen3-235B-A22B", "h200", dict(tp=8, expert_parallel=True))]


def part_b(batches: list[int]) -> dict:
    from tokenmill.plan import choose_split, get_hardware, load_model_shape, make_plan

    out = {}
    for model, hw_name, split in PART_B:
        shape, hw = load_model_shape(model), get_hardware(hw_name)
        for batch in batches:
            par = make_plan(shape, hw, "bf16", "bf16", batch, 2048, 256, **split)["parallel"]
            big = par["stages"][par["largest_stage"]]
            out[f"{model} {par['split']} on {hw.name} batch {batch}"] = {
                "weights_per_device_GiB": round(big["weight_bytes"] / 2**30, 2),
                "max_concurrent_seqs": par["max_concurrent_seqs"],
                "decode_comm_ms": round(par["decode_comm"]["total_s"] * 1e3, 3),
                "decode_step_ms": round(par["decode_step_s"] * 1e3, 3),
                "tokens_per_s_total": round(par["tokens_per_s_total"], 1), "ttft_ms": round(par["ttft_s"] * 1e3, 1),
                "moe": par["moe"]}
    picks = {f"{m} on {n} x {per} {h}": str(choose_split(load_model_shape(m), get_hardware(h), "bf16", n, per)["split"])
             for m, h, n, per in (("Llama-3.1-70B", "h100", 1, 8), ("Llama-3.1-70B", "h100", 2, 8),
                                  ("Qwen3-235B-A22B", "h200", 1, 8))}
    return {"plans": out, "rules_pick": picks,
            "links": "nominal: NVLink-4 450 GB/s + 5 us per collective, InfiniBand-NDR 50 GB/s + 10 us"}


def summary(result: dict) -> str:
    parts = []
    for name, r in result.get("part_a", {}).get("splits", {}).items():
        pred = r["plan_measured_link"]["decode_step_ms"]
        parts.append(f"{name} {r['decode_step_ms']:.1f} ms (plan {pred:.1f})" if "decode_step_ms" in r
                     else f"{name} refused ({r['error'][:80]})")
    b = result["part_b"]["plans"]
    keys = list(b)
    gpu = "; ".join(f"{k.split(' on ')[0]} b{k.rsplit(' ', 1)[1]}: {b[k]['decode_step_ms']:.2f} ms/step, "
                    f"{b[k]['tokens_per_s_total']:.0f} tok/s" for k in keys)
    return ("decode step on this CPU: " + ("; ".join(parts) or "skipped") + " | plan: " + gpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="prompts decoded together in Part A")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per prompt in Part A")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers of the Part A model (the default's 30)")
    ap.add_argument("--plan-batches", default="1,64", help="decode batches of the Part B plans")
    ap.add_argument("--skip-measured", action="store_true", help="Part B only")
    args = ap.parse_args()
    result = {"load_average_start": load_average(), "threads": torch.get_num_threads()}
    if not args.skip_measured:
        result["part_a"] = part_a(args)
    result["part_b"] = part_b([int(b) for b in args.plan_batches.split(",")])
    result["load_average_end"] = load_average()
    print(json.dumps(result, indent=2))
    print(summary(result))


if __name__ == "__main__":
    main()
