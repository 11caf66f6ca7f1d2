"""Tensor, pipeline and expert parallel on this machine, measured, beside `tokenmill plan`'s prediction; then the
plan for the splits that matter on GPUs.

Part A (measured): decode on a random-weight model of the default model's shape made divisible by 2:
SmolLM2-135M has 9 query heads of 64 and 3 KV heads; the variant has 8 heads of 72 and 2 KV heads (hidden 576,
30 layers, MLP 1536, vocabulary 49152, tied), float32, B (--batch) prompts of --prompt-len tokens. Rows:
- TP=1: one process as the engine runs it (the one-call C decoder stack; threads sized by worker/cpu_threads.py,
  which drops to 1 thread while another process takes a core) and the same at 2B;
- TP=1, 2 threads fixed: TOKENMILL_ADAPTIVE_THREADS=0 (what the issue asks for: TP=1 with 2 threads);
- TP=1 layers: C stack off (`model.use_cpu_stack = False`): the layer-by-layer path every rank of a split model
  runs (the C stack steps aside under TP/PP), so TP=2 against this row is the cost of the split itself;
- TP=2 and PP=2 (two processes, 1 thread each); PP=2 also at 2B. Under PP the scheduler spreads the running
  requests over the pp steps in flight (ceil(running / pp) per step), so B requests decode as two steps of
  B/2, one on each stage (what the plan's PP throughput, pp batches in flight, assumes; its batch is one
  step's, B/2 here).
Measured per row:
- tokens_per_s (the headline): the engine core's decode rate from its own step times over its longest run of
  pure decode steps, the best of --repeats; interval: (time of N output tokens - time of 1) / (N - 1), best
  times of the repeats, and tokens_per_s_from_interval = requests / interval, as a cross-check;
- step_latency: the engine core's time from submitting a decode step to its result (median; mean), and the
  most steps in flight;
- inside every rank (probes installed through collective_rpc): the worker's execute_model time per decode step
  and the time inside each torch.distributed call of the step (all_reduce, all_gather, send, isend, recv),
  with the bytes sent, and a PP stage's wait() on its previous hand-off's isend (isend_wait). compute =
  execute - that. Each call's enter and exit times (CLOCK_MONOTONIC, shared by the processes) are paired
  with the other rank's same call, which splits a rank's collective time into waiting for the peer to arrive
  and the collective after both arrived;
- the same collectives at the step's sizes apart, between two otherwise idle gloo processes (1 thread each),
  run just before the row: back to back, and after ~1 ms of matmuls on both ranks (as inside a step; the
  median time after both arrived, from the paired clocks);
- engine overhead = mean step latency - the slowest rank's mean execute (scheduling, ZMQ, the reply).
Beside each: the plan's prediction for the same split (this CPU measured now at the rank's thread count, with
the nominal loopback link and with the link measured in the run).

Part B (plan only): Llama-3.1-70B bf16 on 8 x H100 (TP=8) vs 2 nodes of 8 (TP=8 x PP=2), and Qwen3-235B-A22B
bf16 on 8 x H200 with TP=8 vs EP, at batch 1 and 64.

Part C (measured): expert parallel on a random-weight Mixtral-layout model built here (hidden 576, 8 heads of
72, 2 KV heads, 8 experts of width 1536, top-2, --moe-layers layers, vocabulary 49152, tied, float32): one
process vs tensor_parallel_size=2 (every rank holds half of every expert's width) vs tensor_parallel_size=2
with enable_expert_parallel=True (4 whole experts per rank), at batch 1 and 8, with the same probes, the expert
load the engine recorded, and the plan's prediction. Then the two ways to combine one MoE layer's output, on the
2-rank gloo world at the same token counts: the engine's (activations replicated, one all-reduce of
[T, hidden]) vs an all-to-all EP (token t owned by rank t % 2, its top-2 experts drawn uniformly, a count
exchange and an all_to_all_single dispatch of the top_k x T routed rows, an all_to_all_single combine back).

A split the engine refuses is reported with its error, never a number. On 2 cores TP/PP/EP are a correctness
vehicle: two processes share two cores and one memory bus and add collectives, so they are not expected to beat
one process; the win is on GPUs (Part B).

Prints a JSON result and one summary line: `python benchmarks/parallel.py` (2-3.5 minutes here).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))

from common import load_average  # noqa: E402

SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2, head_dim=72,
             intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
             rms_norm_eps=1e-5, rope_theta=100000.0)
MOE_SHAPE = dict(SHAPE, num_hidden_layers=6, num_local_experts=8, num_experts_per_tok=2, sliding_window=None,
                 router_jitter_noise=0.0)


def build_model(root: str, layers: int) -> tuple[str, dict]:
    import transformers

    cfg = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root, safe_serialization=True)
    return root, cfg.to_dict()


def build_moe_model(root: str, layers: int) -> tuple[str, dict]:
    import transformers

    cfg = transformers.MixtralConfig(**{**MOE_SHAPE, "num_hidden_layers": layers})
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).save_pretrained(root, safe_serialization=True)
    return root, cfg.to_dict()


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


# -- probes: run inside every rank (collective_rpc pickles these by reference, so they live in a module the
# ranks import: this file as `parallel`, its folder being on the path the mp executor hands its ranks) --------
_probe: dict = {"kind": "other", "stats": defaultdict(lambda: defaultdict(float)), "calls": []}
_SENT = {"all_reduce": lambda n, b: 2 * (n - 1) / n * b, "all_gather": lambda n, b: (n - 1) * b,
         "send": lambda n, b: b, "isend": lambda n, b: b, "recv": lambda n, b: 0}


class _TimedWork:
    """A pending isend (a pipeline stage's hand-off) whose wait() is timed: the stage waits on it before its
    next hand-off, inside a later step, so the time goes to that step's kind as "isend_wait"."""

    def __init__(self, work) -> None:
        self._work = work

    def wait(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            b = _probe["stats"][_probe["kind"]]
            b["isend_wait_s"] += time.perf_counter() - t
            b["isend_wait_calls"] += 1

    def __getattr__(self, name):
        return getattr(self._work, name)


def _timed_collective(name: str, fn):
    import torch.distributed as dist

    def call(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t
        tensor = args[1] if name == "all_gather" else args[0]
        payload = tensor.numel() * tensor.element_size()
        b = _probe["stats"][_probe["kind"]]
        b[f"{name}_s"] += dt
        b[f"{name}_calls"] += 1
        b[f"{name}_payload_bytes"] += payload
        b["sent_bytes"] += _SENT[name](dist.get_world_size(kwargs.get("group")), payload)
        if _probe["kind"] == "decode":  # enter and exit on CLOCK_MONOTONIC, which all processes share
            _probe["calls"].append((name, t, t + dt))
        return _TimedWork(out) if name == "isend" else out
    call.probed = True
    return call


def probe_install(worker, cpu_stack: bool = True) -> int:
    """Time this rank's collectives and its execute_model per kind of step; returns the rank's threads."""
    import torch.distributed as dist

    for name in _SENT:
        if not getattr(getattr(dist, name), "probed", False):
            setattr(dist, name, _timed_collective(name, getattr(dist, name)))
    if not cpu_stack:
        worker.runner.model.use_cpu_stack = False
    if not getattr(worker, "_probed", False):
        run = worker.execute_model

        def execute_model(so):
            sizes = [len(s.token_ids) for s in so.scheduled]
            kind = "decode" if sizes and max(sizes) == 1 else ("prefill" if sizes else "empty")
            _probe["kind"] = kind
            t = time.perf_counter()
            try:
                return run(so)
            finally:
                b = _probe["stats"][kind]
                b["execute_s"] += time.perf_counter() - t
                b["steps"] += 1
                b["tokens"] += sum(sizes)
                _probe["kind"] = "other"
        worker.execute_model = execute_model
        worker._probed = True
    return torch.get_num_threads()


def probe_take(worker) -> dict:
    """This rank's decode-step figures since the last take (then reset), and its current thread count."""
    d = _probe["stats"].get("decode", {})
    steps, tokens = d.get("steps", 0), d.get("tokens", 0)
    calls = _probe["calls"]
    _probe["stats"].clear()
    _probe["calls"] = []
    if not steps:
        return {"threads": torch.get_num_threads(), "decode_steps": 0}
    ops = [n for n in [*_SENT, "isend_wait"] if d.get(f"{n}_calls")]
    comm = sum(d[f"{n}_s"] for n in ops)
    return {"threads": torch.get_num_threads(), "decode_steps": int(steps),
            "execute_ms": round(d["execute_s"] / steps * 1e3, 3),
            "collectives_ms": round(comm / steps * 1e3, 3),
            "compute_ms": round((d["execute_s"] - comm) / steps * 1e3, 3),
            "per_op_ms": {n: round(d[f"{n}_s"] / steps * 1e3, 3) for n in ops},
            "calls_per_step": {n: round(d[f"{n}_calls"] / steps, 2) for n in ops},
            "payload_bytes_per_call": {n: int(d[f"{n}_payload_bytes"] / d[f"{n}_calls"]) for n in ops
                                       if n in _SENT},
            "sent_bytes_per_token": int(d.get("sent_bytes", 0) / tokens), "calls": calls}


def split_waits(ranks: list[dict]) -> None:
    """Split each rank's time inside collectives into waiting for the peer and the collective itself, from the
    two ranks' enter/exit times of the same call (the i-th decode-step collective of one rank pairs with the
    i-th of the other: TP ranks call the same sequence, a PP stage's isend pairs with the next stage's recv).
    A call that returned before the peer entered (an isend, a buffered send) is all its own time."""
    calls = [r.pop("calls", []) for r in ranks]
    if len(ranks) != 2 or not calls[0] or len(calls[0]) != len(calls[1]):
        for r in ranks:
            r["paired_calls"] = False
        return
    wait, own = [0.0, 0.0], [0.0, 0.0]
    for pair in zip(*calls):
        last = max(c[1] for c in pair)
        for i, (_, enter, leave) in enumerate(pair):
            if leave <= last:
                own[i] += leave - enter
            else:
                wait[i] += last - enter
                own[i] += leave - last
    for i, r in enumerate(ranks):
        r["paired_calls"] = True
        r["waiting_for_peer_ms"] = round(wait[i] / r["decode_steps"] * 1e3, 3)
        r["collective_after_both_arrived_ms"] = round(own[i] / r["decode_steps"] * 1e3, 3)


def _self():
    """This file as the module `parallel`, whatever name it runs under (the ranks import it by that name)."""
    return sys.modules[__name__] if __name__ != "__main__" else importlib.import_module("parallel")


# -- the engine ----------------------------------------------------------------------------------------------
def _generate_s(llm, prompts, tokens: int) -> float:
    from tokenmill import SamplingParams

    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    return time.perf_counter() - t


def _watch_steps(engine) -> list:
    """(time, latency, requests, pure decode?, steps in flight) of every step the engine core folds in."""
    seen, fold = [], engine._fold_in

    def fold_in(sched, result, t0):
        now = time.perf_counter()
        n = len(sched.scheduled)
        seen.append((now, now - t0, n, bool(n) and sched.num_batched_tokens == n == sched.num_decodes,
                     1 + len(getattr(engine, "batch_queue", ()))))
        return fold(sched, result, t0)
    engine._fold_in = fold_in
    return seen


def steady_tokens_per_s(seen: list) -> float | None:
    """Tokens per second over the longest run of consecutive pure decode steps (requests finishing at the
    end included): the decode rate with prefill left out, whatever the steps in flight. The headline
    throughput (a rate from the engine's own step times, so a slow 1-token run cannot skew it)."""
    best, run = [], []
    for s in seen:
        run = run + [s] if s[3] else []
        if len(run) > len(best):
            best = run
    if len(best) < 3:
        return None
    return sum(s[2] for s in best[1:]) / (best[-1][0] - best[0][0])


def start(model: str, split: dict, max_seqs: int, cpu_stack: bool = True):
    from tokenmill import LLM

    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes="256MiB",
              enable_prefix_caching=False, max_num_seqs=max_seqs, **split)
    llm.engine.executor.collective_rpc(_self().probe_install, (cpu_stack,))
    llm.steps_seen = _watch_steps(llm.engine)
    return llm


def measure(llm, batch: int, prompt_len: int, tokens: int, repeats: int) -> dict:
    """Decode at `batch`: the repeat with the best steady decode rate, its engine steps and rank probes; the
    interval from the best N-token and the best 1-token times over the repeats."""
    ex, steps = llm.engine.executor, llm.steps_seen
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(100, SHAPE["vocab_size"], (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    _generate_s(llm, prompts, 2)  # warm up
    best, t_n, t_1 = None, [], []
    for _ in range(repeats):
        ex.collective_rpc(_self().probe_take)
        steps.clear()
        t_n.append(_generate_s(llm, prompts, tokens))
        ranks, seen = ex.collective_rpc(_self().probe_take), list(steps)
        t_1.append(_generate_s(llm, prompts, 1))
        steady = steady_tokens_per_s(seen) or 0.0
        if best is None or steady > best[0]:
            best = (steady, seen, ranks)
    steady, seen, ranks = best
    interval = (min(t_n) - min(t_1)) / (tokens - 1)
    split_waits(ranks)
    dec = [s for s in seen if s[3]]
    lat = [s[1] for s in dec]
    r = {"tokens_per_s": round(steady, 1),
         "step_latency_ms": round(statistics.median(lat) * 1e3, 3) if lat else None,
         "step_latency_mean_ms": round(statistics.mean(lat) * 1e3, 3) if lat else None,
         "steps_in_flight_max": max((s[4] for s in dec), default=0),
         "requests_per_step": round(statistics.mean(s[2] for s in dec), 2) if dec else 0,
         "interval_ms": round(interval * 1e3, 3), "tokens_per_s_from_interval": round(batch / interval, 1),
         "ranks": ranks}
    slowest = max((x.get("execute_ms", 0) for x in ranks), default=0)
    if lat and r["steps_in_flight_max"] == 1:  # with 2 in flight a step also queues behind the other
        r["engine_overhead_ms"] = round(r["step_latency_mean_ms"] - slowest, 3)  # both means over the steps
    return r


def run_split(model: str, split: dict, batches: list[int], args, cpu_stack: bool = True) -> dict:
    """Every batch of one split in one engine, or the engine's refusal."""
    try:
        llm = start(model, split, max(batches), cpu_stack)
    except Exception as e:  # noqa: BLE001 - a refusal is a result here
        return _error(e)
    try:
        out = {f"batch {b}": measure(llm, b, args.prompt_len, args.tokens, args.repeats)
               for b in batches}
        load = getattr(llm.engine, "expert_load", None)
        if load is not None:
            out["expert_load"] = expert_load_summary(load, split)
        return out
    except Exception as e:  # noqa: BLE001
        return _error(e)
    finally:
        llm.engine.shutdown()


def expert_load_summary(load, split: dict) -> dict:
    """Tokens routed per expert over the run (all MoE layers), and each EP rank's share when split 2 ways."""
    import numpy as np

    per_expert = np.asarray(load).sum(axis=0)
    halves = per_expert.reshape(2, -1).sum(axis=1)
    per_layer_rank = np.asarray(load).reshape(len(load), 2, -1).sum(axis=2)  # [layer, rank]
    return {"tokens_per_expert": per_expert.tolist(),
            "rank_share_if_ep2": [round(float(h / halves.sum()), 3) for h in halves],
            "busiest_rank_per_layer_mean": round(float((per_layer_rank.max(axis=1)
                                                        / per_layer_rank.mean(axis=1)).mean()), 3)}


# -- collectives apart: two otherwise idle gloo processes, kept for the whole run -------------------------------
def _median_s(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls, back to back."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _paired_after_compute(fn, reps: int, between) -> tuple[float, float]:
    """fn() after `between` (compute) on both ranks, as inside a step: (median seconds in fn on this rank,
    median seconds from the later rank's arrival to this rank's return), the ranks' clocks being the same."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    calls = []
    for _ in range(reps):
        between()
        t = time.perf_counter()
        fn()
        calls.append((t, time.perf_counter()))
    both = [None, None]
    dist.all_gather_object(both, calls)
    mine = both[dist.get_rank()]
    after = sorted(leave - max(enter, other[0]) if leave > other[0] else leave - enter
                   for (enter, leave), other in zip(mine, both[1 - dist.get_rank()]))
    total = sorted(leave - enter for enter, leave in mine)
    return total[len(total) // 2], after[len(after) // 2]


def _a2a_sends(rank: int, tokens: int, experts: int, top_k: int, seed: int = 0) -> list[int]:
    """Rows this rank sends to each rank in an all-to-all EP over 2 ranks: token t is owned by rank t % 2
    (attention data parallel), its top_k experts drawn uniformly; expert e lives on rank e // (experts / 2)."""
    g = torch.Generator().manual_seed(seed)
    send = [0, 0]
    for t in range(tokens):
        chosen = torch.randperm(experts, generator=g)[:top_k]
        if t % 2 == rank:
            for e in chosen.tolist():
                send[e // (experts // 2)] += 1
    return send


def _comm_job(rank: int, job: dict, reps: int) -> dict:
    import torch.distributed as dist

    if job["kind"] == "link":
        big = torch.randn(1 << 20)  # 4 MiB: the link's bandwidth
        return {"all_reduce_4MiB_s": _median_s(lambda: dist.all_reduce(big), max(5, reps // 10))}
    if job["kind"] == "step":  # Part A's collectives at a step's sizes
        x = torch.randn(job["batch"], job["hidden"])
        logits = torch.randn(job["batch"], -(-job["vocab"] // 2))
        parts = [torch.empty_like(logits) for _ in range(2)]
        pair = [torch.randn(job["batch"], job["hidden"]) for _ in range(2)]
        w = torch.randn(job["intermediate"], job["hidden"])  # a rank's gate/up half; 4 matmuls between calls

        def ping_pong():  # PP's hop: hidden + residual to the other stage and back (timed, then halved)
            for step in (0, 1):
                for t in pair:
                    dist.send(t, 1 - rank) if rank == step else dist.recv(t, 1 - rank)

        total, after = _paired_after_compute(lambda: dist.all_reduce(x), reps // 2,
                                             lambda: [x @ w.T for _ in range(4)])
        return {"all_reduce_s": _median_s(lambda: dist.all_reduce(x), reps),
                "all_reduce_after_compute_s": total, "all_reduce_after_compute_both_arrived_s": after,
                "all_gather_logits_s": _median_s(lambda: dist.all_gather(parts, logits), reps),
                "send_recv_s": _median_s(ping_pong, reps) / 2}
    # "moe": one MoE layer's combine, the engine's all-reduce vs an all-to-all dispatch + combine
    out = {}
    for tokens in job["tokens"]:
        y = torch.randn(tokens, job["hidden"])
        send = _a2a_sends(rank, tokens, job["experts"], job["top_k"])
        counts_out, counts_in = torch.tensor(send, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
        dist.all_to_all_single(counts_in, counts_out)
        recv = counts_in.tolist()
        rows_out, rows_in = torch.randn(sum(send), job["hidden"]), torch.empty(sum(recv), job["hidden"])
        back_out, back_in = torch.randn(sum(recv), job["hidden"]), torch.empty(sum(send), job["hidden"])

        def dispatch():
            dist.all_to_all_single(counts_in, counts_out)  # a receiver learns how many rows come
            dist.all_to_all_single(rows_in, rows_out, recv, send)

        def combine():
            dist.all_to_all_single(back_in, back_out, send, recv)

        row = job["hidden"] * 4
        out[tokens] = {"all_reduce_s": _median_s(lambda: dist.all_reduce(y), reps),
                       "all_reduce_payload_bytes": tokens * row,
                       "a2a_dispatch_s": _median_s(dispatch, reps), "a2a_combine_s": _median_s(combine, reps),
                       "a2a_dispatch_plus_combine_s": _median_s(lambda: (dispatch(), combine()), reps),
                       "a2a_rows_out_this_rank": send, "a2a_remote_bytes_this_rank": 2 * send[1 - rank] * row}
    return out


def _comm_rank(rank: int, port: int, jobs, out, reps: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    while (job := jobs.get()) is not None:  # idle (blocked on the queue) while the engine runs
        res = _comm_job(rank, job, reps)
        dist.barrier()
        if rank == 0:
            out.put(res)
    dist.destroy_process_group()


class CommWorld:
    """Two gloo processes of this machine (1 thread each, like the ranks) that run a step's collectives at a
    step's sizes on demand, between the engine runs, so each measurement sees the load of its moment."""

    def __init__(self, reps: int = 200) -> None:
        import torch.multiprocessing as mp

        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
        from dist_utils import free_port

        ctx = mp.get_context("spawn")
        self.jobs, self.out, port = [ctx.Queue(), ctx.Queue()], ctx.Queue(), free_port()
        self.procs = [ctx.Process(target=_comm_rank, args=(r, port, self.jobs[r], self.out, reps), daemon=True)
                      for r in range(2)]
        for p in self.procs:
            p.start()

    def run(self, **job) -> dict:
        for q in self.jobs:
            q.put(job)
        return self.out.get(timeout=300)

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)


def measured_link(comm: dict, payload: int):
    """An Interconnect from the measurements: bandwidth from the 4 MiB all-reduce (over 2 ranks a ring sends
    2(n-1)/n = all of the payload per rank), latency from the step-sized one less its bytes' time."""
    from tokenmill.perf.hardware import Interconnect

    bandwidth = 4 * 2**20 / comm["all_reduce_4MiB_s"]
    latency = max(0.0, comm["all_reduce_s"] - payload / bandwidth)
    return Interconnect("loopback-measured", bandwidth, latency, "node", "gloo on this machine, measured now")


# -- the plan's predictions ----------------------------------------------------------------------------------
def rank_hardware(threads: int, bandwidth_share: float = 1.0):
    """This CPU measured at `threads` threads; bandwidth_share < 1 when ranks stream memory at the same time."""
    from dataclasses import replace

    from tokenmill.perf.hardware import measure_local_cpu

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        hw = measure_local_cpu(("fp32",))
    finally:
        torch.set_num_threads(before)
    return replace(hw, bandwidth=hw.bandwidth * bandwidth_share)


def predict(shape, hw, tp: int, pp: int, batch: int, prompt_len: int, tokens: int, link=None,
            ep: bool = False) -> dict:
    from tokenmill.plan import make_plan

    links = {"node_link": link, "net_link": link} if link else {}
    p = make_plan(shape, hw, "fp32", "fp32", batch, prompt_len, tokens, tp, "fp32", 0.9, pp, expert_parallel=ep,
                  **links)
    par = p.get("parallel")
    if par is None:
        step = p["decode"]["step_time_s"]
        return {"decode_step_ms": round(step * 1e3, 3), "comm_ms": 0.0, "bytes_per_token": 0,
                "tokens_per_s": round(batch / step, 1)}
    c = par["comm_per_token"]
    return {"decode_step_ms": round(par["decode_step_s"] * 1e3, 3),
            "compute_ms": round(par["decode_compute_s"] * 1e3, 3),
            "comm_ms": round(par["decode_comm"]["total_s"] * 1e3, 3),
            "bytes_per_token": int(c["tp_sent"] + c["logits_gather_sent"]
                                   + c["pp_boundaries"] * c["pp_sent_per_boundary"]),
            "tokens_per_s": round(par["tokens_per_s_total"], 1)}


# -- Part A ----------------------------------------------------------------------------------------------------
def part_a_splits(b: int) -> dict:
    """name -> (engine arguments, batches, C stack on)."""
    return {"TP=1": (dict(tensor_parallel_size=1), [b, 2 * b], True),
            "TP=1, 2 threads fixed": (dict(tensor_parallel_size=1), [b], True),
            "TP=1 layers": (dict(tensor_parallel_size=1), [b], False),
            "TP=2": (dict(tensor_parallel_size=2), [b], True),
            "PP=2": (dict(pipeline_parallel_size=2), [b, 2 * b], True)}


def apart_figures(c: dict, layers: int, tp: bool) -> dict:
    """Part of a step's communication measured apart: per call, and the step's calls summed."""
    per_step = (2 * layers + 1) * c["all_reduce_s"] + c["all_gather_logits_s"] if tp else c["send_recv_s"]
    return {"all_reduce_us": round(c["all_reduce_s"] * 1e6, 1),
            "all_reduce_after_compute_us": round(c["all_reduce_after_compute_s"] * 1e6, 1),
            "all_reduce_after_compute_both_arrived_us": round(c["all_reduce_after_compute_both_arrived_s"] * 1e6, 1),
            "all_gather_logits_us": round(c["all_gather_logits_s"] * 1e6, 1),
            "send_recv_us": round(c["send_recv_s"] * 1e6, 1), "step_ms": round(per_step * 1e3, 3)}


def part_a(args, world: CommWorld, hw: dict) -> dict:
    from tokenmill.plan import ModelShape

    t0, load0 = time.perf_counter(), load_average()
    root = tempfile.mkdtemp(prefix="tokenmill-parallel-")
    model, cfg = build_model(root, args.layers)
    shape = ModelShape.from_hf_config(cfg, name="SmolLM2-shape, 8 heads x 72, 2 KV heads")
    step_job = dict(kind="step", hidden=SHAPE["hidden_size"], vocab=SHAPE["vocab_size"],
                    intermediate=SHAPE["intermediate_size"])
    first = {**world.run(kind="link"), **world.run(**step_job, batch=args.batch)}
    link = measured_link(first, args.batch * SHAPE["hidden_size"] * 4)
    out = {}
    for name, (split, batches, stack) in part_a_splits(args.batch).items():
        tp, pp = split.get("tensor_parallel_size", 1), split.get("pipeline_parallel_size", 1)
        # the collectives' sizes and the plan's batch are one step's: PP spreads b requests over pp steps
        apart = world.run(**step_job, batch=-(-batches[0] // pp)) if tp * pp > 1 else None
        fixed = "threads fixed" in name and "TOKENMILL_ADAPTIVE_THREADS" not in os.environ
        if fixed:  # read when the (in-process) worker is built
            os.environ["TOKENMILL_ADAPTIVE_THREADS"] = "0"
        try:
            res = run_split(model, split, batches, args, cpu_stack=stack)
        finally:
            if fixed:
                del os.environ["TOKENMILL_ADAPTIVE_THREADS"]
        if "error" in res:
            out[name] = res
            continue
        for b in batches:
            r = res[f"batch {b}"]
            r["batch"], r["prompt_len"] = b, args.prompt_len
            if apart is not None and b == batches[0]:
                r["collectives_apart"] = apart_figures(apart, args.layers, tp > 1)
            hwk = 1 if tp * pp == 1 else ("tp" if tp > 1 else "pp")
            plan_b = -(-b // pp)  # the plan's batch is one step's
            r["plan_nominal_link"] = predict(shape, hw[hwk], tp, pp, plan_b, args.prompt_len, args.tokens)
            r["plan_measured_link"] = predict(shape, hw[hwk], tp, pp, plan_b, args.prompt_len, args.tokens, link)
            out[name if b == args.batch or len(batches) == 1 else f"{name}, batch {b}"] = r
    return {"model": shape.name, "config": {**SHAPE, "num_hidden_layers": args.layers}, "splits": out,
            "collectives_apart_first": apart_figures(first, args.layers, True),
            "link_measured": {"bandwidth_GB_s": round(link.bandwidth / 1e9, 3),
                              "latency_us": round(link.latency * 1e6, 1)},
            "workload": {"batch": args.batch, "prompt_len": args.prompt_len, "tokens": args.tokens,
                         "repeats": args.repeats},
            "load_average": [load0, load_average()], "seconds": round(time.perf_counter() - t0, 1)}


# -- Part C ----------------------------------------------------------------------------------------------------
MOE_SPLITS = {"1 process": dict(tensor_parallel_size=1), "TP=2": dict(tensor_parallel_size=2),
              "EP=2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}


def part_c(args, world: CommWorld, hw: dict) -> dict:
    from tokenmill.plan import ModelShape

    t0, load0 = time.perf_counter(), load_average()
    root = tempfile.mkdtemp(prefix="tokenmill-parallel-moe-")
    model, cfg = build_moe_model(root, args.moe_layers)
    shape = ModelShape.from_hf_config(cfg, name="Mixtral-layout, 8 x 1536 experts, top-2")
    batches = [int(b) for b in args.moe_batches.split(",")]
    out = {}
    for name, split in MOE_SPLITS.items():
        r = run_split(model, split, batches, args)
        tp, ep = split["tensor_parallel_size"], split.get("enable_expert_parallel", False)
        for b in batches:
            if f"batch {b}" in r:
                r[f"batch {b}"]["plan_nominal_link"] = predict(shape, hw[1 if tp == 1 else "tp"], tp, 1, b,
                                                               args.prompt_len, args.tokens, ep=ep)
        out[name] = r
    combine = {}
    moe = world.run(kind="moe", tokens=batches, hidden=MOE_SHAPE["hidden_size"],
                    experts=MOE_SHAPE["num_local_experts"], top_k=MOE_SHAPE["num_experts_per_tok"])
    for tokens, m in moe.items():
        combine[f"T={tokens}"] = {
            "all_reduce_us": round(m["all_reduce_s"] * 1e6, 1),
            "all_reduce_payload_bytes": m["all_reduce_payload_bytes"],
            "a2a_dispatch_us": round(m["a2a_dispatch_s"] * 1e6, 1),
            "a2a_combine_us": round(m["a2a_combine_s"] * 1e6, 1),
            "a2a_dispatch_plus_combine_us": round(m["a2a_dispatch_plus_combine_s"] * 1e6, 1),
            "a2a_rows_out_rank0": m["a2a_rows_out_this_rank"],
            "a2a_remote_bytes_rank0": m["a2a_remote_bytes_this_rank"],
            "a2a_over_all_reduce": round(m["a2a_dispatch_plus_combine_s"] / m["all_reduce_s"], 2)}
    return {"model": shape.name, "config": {**MOE_SHAPE, "num_hidden_layers": args.moe_layers}, "splits": out,
            "moe_combine_one_layer": combine,
            "workload": {"batches": batches, "prompt_len": args.prompt_len, "tokens": args.tokens,
                         "repeats": args.repeats},
            "load_average": [load0, load_average()], "seconds": round(time.perf_counter() - t0, 1)}


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
        if "tokens_per_s" not in r:
            parts.append(f"{name} refused ({r['error'][:80]})")
            continue
        comm = max((x.get("collectives_ms", 0) for x in r["ranks"]), default=0)
        parts.append(f"{name} (b{r['batch']}) {r['tokens_per_s']:.0f} tok/s, step {r['step_latency_ms']:.1f} ms"
                     + (f" ({comm:.1f} in collectives)" if comm else "")
                     + (f", {r['steps_in_flight_max']} steps in flight of {r['requests_per_step']:g}"
                        if r["steps_in_flight_max"] > 1 else "")
                     + f" [plan {r['plan_measured_link']['tokens_per_s']:.0f} tok/s]")
    moe = []
    for name, r in result.get("part_c", {}).get("splits", {}).items():
        if "error" in r:
            moe.append(f"{name} refused ({r['error'][:80]})")
            continue
        moe.append(f"{name} " + ", ".join(f"b{k.split()[1]} {v['tokens_per_s']:.0f}"
                                          for k, v in r.items() if k.startswith("batch ")) + " tok/s")
    comb = "; ".join(f"{k} all-reduce {v['all_reduce_us']:.0f} us vs all-to-all {v['a2a_dispatch_plus_combine_us']:.0f}"
                     " us" for k, v in result.get("part_c", {}).get("moe_combine_one_layer", {}).items())
    b = result["part_b"]["plans"]
    gpu = "; ".join(f"{k.split(' on ')[0]} b{k.rsplit(' ', 1)[1]}: {v['decode_step_ms']:.2f} ms/step, "
                    f"{v['tokens_per_s_total']:.0f} tok/s" for k, v in b.items())
    return ("decode on this CPU: " + ("; ".join(parts) or "skipped") + " | MoE: " + ("; ".join(moe) or "skipped")
            + (" | MoE combine: " + comb if comb else "") + " | plan: " + gpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4, help="prompts decoded together in Part A")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=16, help="output tokens per prompt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers of the Part A model (the default's 30)")
    ap.add_argument("--moe-layers", type=int, default=MOE_SHAPE["num_hidden_layers"],
                    help="decoder layers of the Part C Mixtral-layout model")
    ap.add_argument("--moe-batches", default="1,8", help="decode batches of Part C")
    ap.add_argument("--plan-batches", default="1,64", help="decode batches of the Part B plans")
    ap.add_argument("--skip-measured", action="store_true", help="Part B only")
    ap.add_argument("--skip-moe", action="store_true", help="no Part C")
    ap.add_argument("--fixed-threads", action="store_true",
                    help="TOKENMILL_ADAPTIVE_THREADS=0: TP=1 keeps 2 threads even beside a busy neighbour (there its "
                    "spinning threads collapse: measured 104 vs 14 ms per step on a 4-layer model)")
    args = ap.parse_args()
    if args.fixed_threads:
        os.environ["TOKENMILL_ADAPTIVE_THREADS"] = "0"  # the ranks inherit it
    result = {"load_average_start": load_average(), "threads": torch.get_num_threads(),
              "adaptive_threads": not args.fixed_threads}
    if not args.skip_measured:
        world = CommWorld()
        try:
            hw = {1: rank_hardware(2), "tp": rank_hardware(1, 0.5), "pp": rank_hardware(1)}
            result["part_a"] = part_a(args, world, hw)
            if not args.skip_moe:
                result["part_c"] = part_c(args, world, hw)
        finally:
            world.close()
    result["part_b"] = part_b([int(b) for b in args.plan_batches.split(",")])
    result["load_average_end"] = load_average()
    print(json.dumps(result, indent=2))
    print(summary(result))


if __name__ == "__main__":
    main()
